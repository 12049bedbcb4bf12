-- KEYS: w, r   ARGV: epoch   -> {code, old reverse blob}; marks the worker "needs resync"
--#include _epoch_ok.lua
--#include _reverse.lua
local code = epoch_state(KEYS[1], tonumber(ARGV[1]))
if code ~= OK then return {code, ''} end
redis.call('HSET', KEYS[1], 'seq', -1)
return {OK, rev_all(KEYS[2])}
