-- Block-set primitives over a blob of records (16-byte digests from events, KEY-byte keys
-- from reverse indexes), keyed by each record's first KEY bytes, in chunks of at most 256
-- keys per call.
--#include _key.lua
--#include _holders.lua
local CHUNK = 256

local function code_of(id)
  return struct.pack('>H', tonumber(id))
end

local function without(v, code)
  local parts = {}
  for k = 1, #v, 2 do
    local c = string.sub(v, k, k + 1)
    if c ~= code then parts[#parts + 1] = c end
  end
  return table.concat(parts)
end

-- v with the 2-byte code old replaced by new, in place (the holders keep their order)
local function swapped(v, old, new)
  local parts = {}
  for k = 1, #v, 2 do
    local c = string.sub(v, k, k + 1)
    parts[#parts + 1] = c == old and new or c
  end
  return table.concat(parts)
end

-- calls fn(keys, values) for each chunk of the blob of `size`-byte records; values from the
-- block hash
local function each_chunk(bkey, blob, size, fn)
  local n = math.floor(#blob / size)
  for s = 0, n - 1, CHUNK do
    local digests = {}
    for j = s, math.min(n, s + CHUNK) - 1 do
      digests[#digests + 1] = string.sub(blob, j * size + 1, j * size + KEY)
    end
    fn(digests, redis.call('HMGET', bkey, unpack(digests)))
  end
end

-- adds the worker (code) at tier code tcode to every block of the blob (one it holds at
-- another tier moves to this one); returns the keys it newly holds
local function add_blocks(bkey, code, blob, size, tcode)
  local added, seen = {}, {}
  each_chunk(bkey, blob, size, function(digests, vals)
    local kv = {}
    for j = 1, #digests do
      local d, v = digests[j], vals[j]
      if v and #v % 2 == 1 then v = nil end  -- junk, not 2-byte ids: overwrite it
      if not seen[d] then
        seen[d] = true
        local held = held_as(v, code)
        if not held then
          kv[#kv + 1] = d
          kv[#kv + 1] = v and v .. tcode or tcode
          added[#added + 1] = d
        elseif held ~= tcode then
          kv[#kv + 1] = d
          kv[#kv + 1] = swapped(v, held, tcode)
        end
      end
    end
    if #kv > 0 then redis.call('HSET', bkey, unpack(kv)) end
  end)
  return added
end

-- removes the worker from every block of the blob; returns how many entries it dropped
local function remove_blocks(bkey, code, blob, size)
  local removed, seen = 0, {}
  each_chunk(bkey, blob, size, function(digests, vals)
    local kv, dels = {}, {}
    for j = 1, #digests do
      local d, v = digests[j], vals[j]
      if v and #v % 2 == 1 and not seen[d] then  -- junk, not 2-byte ids: drop the field
        seen[d] = true
        dels[#dels + 1] = d
      elseif v and not seen[d] then
        local held = held_as(v, code)
        if held then
          seen[d] = true
          removed = removed + 1
          if v == held then
            dels[#dels + 1] = d
          else
            kv[#kv + 1] = d
            kv[#kv + 1] = without(v, held)
          end
        end
      end
    end
    if #kv > 0 then redis.call('HSET', bkey, unpack(kv)) end
    if #dels > 0 then redis.call('HDEL', bkey, unpack(dels)) end
  end)
  return removed
end

-- the keys of the blob (of KEY-byte records) the worker really holds, once each
local function held_blocks(bkey, code, blob)
  local keep, seen = {}, {}
  each_chunk(bkey, blob, KEY, function(digests, vals)
    for j = 1, #digests do
      local d, v = digests[j], vals[j]
      if v and not seen[d] and held_as(v, code) then
        seen[d] = true
        keep[#keep + 1] = d
      end
    end
  end)
  return keep
end
