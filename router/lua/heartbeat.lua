-- KEYS: w, live, load, lv, lz   ARGV: 2-byte id, epoch, ttl_ms, load_payload
-- lz scores each worker by the load version of its latest load, so a lookup returns only the
-- loads changed since the caller's version.
-- -> OK | UNKNOWN_WORKER (register again)
--#include _now.lua
--#include _codes.lua
local st = redis.pcall('HMGET', KEYS[1], 'epoch', 'gc')
if st.err or not st[1] or st[2] or tonumber(st[1]) ~= tonumber(ARGV[2]) then
  return UNKNOWN_WORKER
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
redis.call('ZADD', KEYS[5], redis.call('INCR', KEYS[4]), ARGV[1])
return OK
