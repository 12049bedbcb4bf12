-- KEYS: w, r   ARGV: epoch, seq, blob (KEY-byte keys), pfx, id   -> code
--#include _epoch_ok.lua
--#include _log.lua
--#include _reverse.lua
local code = epoch_state(KEYS[1], tonumber(ARGV[1]))
if code ~= OK then return code end
rev_set(KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'n', #ARGV[3] / KEY)
log_event(ARGV[4], ARGV[5], 'Z', ARGV[3])
return OK
