-- KEYS: w, r   ARGV: epoch, seq, blob   -> code
--#include _epoch_ok.lua
--#include _rev.lua
local code = epoch_state(KEYS[1], tonumber(ARGV[1]))
if code ~= OK then return code end
rev_set(KEYS[1], KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'n', #ARGV[3] / 16)
return OK
