-- The worker's reverse index P.."r:"..id: its digests in the first `rl` bytes (a field of the
-- worker hash) of a string padded with zeros to a jemalloc size class. APPEND would let Redis
-- double the string's allocation (a 49,152-byte index used 98,376 B); here a full string is
-- rewritten by SET at >= 1.15x, which allocates it exactly, and appends fill the padding in place.
local function rev_used(w, rkey)
  local cap = redis.call('STRLEN', rkey)
  return math.min(tonumber(redis.call('HGET', w, 'rl')) or cap, cap), cap
end

local function rev_get(w, rkey)
  local used = rev_used(w, rkey)
  if used == 0 then return '' end
  return redis.call('GETRANGE', rkey, 0, used - 1)
end

-- replaces the reverse index with exactly `blob`
local function rev_set(w, rkey, blob)
  if #blob > 0 then redis.call('SET', rkey, blob) else redis.call('DEL', rkey) end
  redis.call('HSET', w, 'rl', #blob)
end

local function rev_append(w, rkey, blob)
  if #blob == 0 then return end
  local used, cap = rev_used(w, rkey)
  local want = used + #blob
  if want <= cap then
    redis.call('SETRANGE', rkey, used, blob)
  else
    -- the smallest jemalloc size class (4 per power of two) with 15% room; 32 bytes for the
    -- sds header: growth by >= 1.15x keeps the rewrites amortized O(1) per digest
    local need, size = want * 1.15 + 32, 64
    while size < need do size = size * 2 end
    local step = size / 8
    while size - step >= need do size = size - step end
    local pad = math.floor((size - 32 - want) / 16) * 16
    local old = used > 0 and redis.call('GETRANGE', rkey, 0, used - 1) or ''
    redis.call('SET', rkey, old .. blob .. string.rep('\0', math.max(0, pad)))
  end
  redis.call('HSET', w, 'rl', want)
end
