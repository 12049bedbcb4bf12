-- KEYS: reg, live, ids, load, rv, lv, lz   ARGV: pfx, only_id ('' = every expired lease)
-- Marks dead workers (gc flag, out of live/ids/load) and returns their ids.
--#include _now.lua
--#include _log.lua
local pfx = ARGV[1]
local ids
if ARGV[2] ~= '' then
  ids = {}
  if redis.call('SISMEMBER', KEYS[1], ARGV[2]) == 1 then ids[1] = ARGV[2] end
else
  ids = redis.call('SMEMBERS', KEYS[1])
end
local out = {}
if ARGV[2] == '' then
  for _, c in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if #c ~= 2 or redis.call('SISMEMBER', KEYS[1], tostring(struct.unpack('>H', c))) == 0 then
      redis.call('ZREM', KEYS[2], c)
    end
  end
end
local valid = {}
for _, id in ipairs(ids) do
  local nid = tonumber(id)
  if nid and nid == math.floor(nid) and nid >= 1 and nid <= 65535 and tostring(nid) == id then
    valid[#valid + 1] = id
  else
    redis.log(redis.LOG_WARNING, 'prefix index: junk registry member dropped')
    redis.call('SREM', KEYS[1], id)
  end
end
for _, id in ipairs(valid) do
  local code = struct.pack('>H', tonumber(id))
  local dead = ARGV[2] ~= ''
  if not dead then
    local s = redis.call('ZSCORE', KEYS[2], code)
    dead = (not s) or tonumber(s) < now
  end
  if dead then
    local w = pfx .. 'w:' .. id
    local fresh = redis.pcall('HSETNX', w, 'gc', 1)
    if type(fresh) == 'table' then  -- the record is not a hash: replace it
      redis.call('DEL', w)
      fresh = redis.call('HSETNX', w, 'gc', 1)
    end
    if fresh == 1 then
      local rid = redis.call('HGET', w, 'rid')
      if rid and redis.call('HGET', KEYS[3], rid) == id then redis.call('HDEL', KEYS[3], rid) end
      redis.call('ZREM', KEYS[2], code)
      redis.call('HDEL', KEYS[4], code)
      redis.call('ZREM', KEYS[7], code)
      redis.call('INCR', KEYS[5])
      redis.call('INCR', KEYS[6])
      log_event(pfx, id, 'D', '')
    end
    out[#out + 1] = id
  end
end
return out
