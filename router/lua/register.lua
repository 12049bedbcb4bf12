-- KEYS: reg, ids, live, rv, name   ARGV: pfx, rid, epoch, bs, fp, node, ttl_ms, model
-- -> {OK, id} | {STALE_EPOCH, registered_epoch} | {TAG_TAKEN, 0} (tag owned by another model)
--    | {IDS_EXHAUSTED, 0} (16,383 ids in use: a code's top two bits are its tier, _blocks.lua)
--#include _now.lua
--#include _codes.lua
--#include _reverse.lua
local pfx, rid, epoch = ARGV[1], ARGV[2], tonumber(ARGV[3])
local owner = redis.call('GET', KEYS[5])
if owner and owner ~= ARGV[8] then return {TAG_TAKEN, 0} end
if not owner then redis.call('SET', KEYS[5], ARGV[8]) end
local expiry = now + tonumber(ARGV[7])
local id = redis.call('HGET', KEYS[2], rid)
local nid = tonumber(id)
if id and not (nid and nid == math.floor(nid) and nid >= 1 and nid <= 16383
               and redis.call('SISMEMBER', KEYS[1], id) == 1) then
  redis.log(redis.LOG_WARNING, 'prefix index: junk id for ' .. rid .. ' dropped')
  redis.call('HDEL', KEYS[2], rid)
  id = nil
end
if id then
  local w = pfx .. 'w:' .. id
  local old = redis.pcall('HGET', w, 'epoch')
  if type(old) == 'table' then  -- the record is not a hash: rebuild it
    redis.call('DEL', w)
    old = nil
  end
  old = tonumber(old)
  if old and old > epoch then return {STALE_EPOCH, old} end
  if not old then  -- junk or missing record: rebuild it; the resync fixes its entries
    redis.log(redis.LOG_WARNING, 'prefix index: worker record ' .. w .. ' rebuilt')
    redis.call('HDEL', w, 'gc', 'gcpos')
    redis.call('HSET', w, 'rid', rid, 'n', rev_count(pfx .. 'r:' .. id))
  end
  if not old or old < epoch then
    redis.call('HSET', w, 'epoch', ARGV[3], 'bs', ARGV[4], 'fp', ARGV[5], 'node', ARGV[6],
               'seq', -1)
    redis.call('INCR', KEYS[4])
  end
  redis.call('ZADD', KEYS[3], expiry, struct.pack('>H', tonumber(id)))
  return {OK, tonumber(id)}
end
local i = 1
while redis.call('SISMEMBER', KEYS[1], i) == 1 do i = i + 1 end
if i > 16383 then return {IDS_EXHAUSTED, 0} end
redis.call('SADD', KEYS[1], i)
redis.call('HSET', KEYS[2], rid, i)
local w = pfx .. 'w:' .. i
redis.call('DEL', w)
rev_delete(pfx .. 'r:' .. i)
redis.call('HSET', w, 'rid', rid, 'epoch', ARGV[3], 'bs', ARGV[4], 'fp', ARGV[5],
           'node', ARGV[6], 'seq', 0, 'n', 0)
redis.call('ZADD', KEYS[3], expiry, struct.pack('>H', i))
redis.call('INCR', KEYS[4])
return {OK, i}
