-- KEYS: w, r, reg, rv   ARGV: pfx, id, max_blocks   -> {entries removed, done}
--#include _blocks.lua
--#include _reverse.lua
local flagged = redis.pcall('HEXISTS', KEYS[1], 'gc')
if type(flagged) == 'table' or flagged == 0 then return {0, 1} end
local pfx, id, max = ARGV[1], ARGV[2], tonumber(ARGV[3])
local pos = tonumber(redis.call('HGET', KEYS[1], 'gcpos') or '0')
local chunk = rev_range(KEYS[2], pos, max)
local removed = remove_blocks(pfx .. 'B', code_of(id), chunk, KEY)
if #chunk < max * KEY then
  redis.call('DEL', KEYS[1])
  rev_delete(KEYS[2])
  redis.pcall('HDEL', pfx .. 'T', code_of(id))  -- its sampled tails (pcall: junk is no worry)
  redis.call('SREM', KEYS[3], id)
  redis.call('INCR', KEYS[4])
  return {removed, 1}
end
redis.call('HSET', KEYS[1], 'gcpos', pos + max)
return {removed, 0}
