-- A worker's reverse index: the KEY-byte keys of the blocks it holds (and, until compaction,
-- some it no longer holds), in arrival order. New keys are appended to the tail, the string
-- r:<id>; once the tail reaches SEG bytes its whole segments move to the hash r:<id>:s
-- (fields 0, 1, ...), each written whole, so Redis allocates it at its size. A string only
-- appended to would carry up to as much again in spare capacity (Redis doubles a string's
-- allocation as it grows); here only the tail, under 8 KiB, does. A long tail (the one string
-- of earlier versions) is sealed by its next append.
-- router.redis_index.REVERSE_SEGMENT_BYTES holds SEG too.
--#include _key.lua
local SEG = 1023 * KEY  -- 8,184 bytes: with its 5-byte header and NUL, one 8 KiB allocation

local function sealed_key(rkey) return rkey .. ':s' end

-- writes s, the keys from sealed segment k on: its whole segments sealed, the rest the tail
local function rev_write(rkey, k, s)
  local kv, at = {}, 1
  while #s - at + 1 >= SEG do
    kv[#kv + 1], kv[#kv + 2] = k, string.sub(s, at, at + SEG - 1)
    at, k = at + SEG, k + 1
  end
  if #kv > 0 then redis.call('HSET', sealed_key(rkey), unpack(kv)) end
  if at <= #s then redis.call('SET', rkey, string.sub(s, at)) else redis.call('DEL', rkey) end
end

-- appends a blob of KEY-byte keys: one APPEND, and a read of the tail once per SEG bytes
local function rev_append(rkey, blob)
  if #blob > 0 and redis.call('APPEND', rkey, blob) >= SEG then
    rev_write(rkey, redis.call('HLEN', sealed_key(rkey)), redis.call('GET', rkey))
  end
end

-- the number of keys it holds
local function rev_count(rkey)
  local bytes = redis.call('HLEN', sealed_key(rkey)) * SEG + redis.call('STRLEN', rkey)
  return math.floor(bytes / KEY)
end

-- the keys from the pos-th (from 0), at most max of them, as one blob
local function rev_range(rkey, pos, max)
  local k = redis.call('HLEN', sealed_key(rkey))
  local from, to = pos * KEY, (pos + max) * KEY  -- bytes [from, to)
  local first = math.min(math.floor(from / SEG), k)
  local parts, fields = {}, {}
  for i = first, math.min(math.floor((to - 1) / SEG), k - 1) do fields[#fields + 1] = i end
  if #fields > 0 then parts = redis.call('HMGET', sealed_key(rkey), unpack(fields)) end
  for i = 1, #parts do parts[i] = parts[i] or '' end
  if to > k * SEG then parts[#parts + 1] = redis.call('GET', rkey) or '' end
  local base = first * SEG
  return string.sub(table.concat(parts), from - base + 1, to - base)
end

-- every key, as one blob
local function rev_all(rkey)
  return rev_range(rkey, 0, rev_count(rkey) + 1)
end

-- drops every key
local function rev_delete(rkey)
  redis.call('DEL', rkey, sealed_key(rkey))
end

-- replaces every key by the blob's
local function rev_set(rkey, blob)
  rev_delete(rkey)
  rev_write(rkey, 0, blob)
end
