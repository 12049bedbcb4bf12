-- KEYS: live, rv   ARGV: pfx   -> {rv, {id, {rid, epoch, bs, fp, node}, ...}}
--#include _now.lua
local out = {}
for _, c in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  if #c == 2 then  -- anything else is junk, not a worker
    local id = struct.unpack('>H', c)
    local rec = redis.pcall('HMGET', ARGV[1] .. 'w:' .. id, 'rid', 'epoch', 'bs', 'fp', 'node')
    if rec.err then rec = {false, false, false, false, false} end
    out[#out + 1] = id
    out[#out + 1] = rec
  end
end
return {redis.call('GET', KEYS[2]) or '0', out}
