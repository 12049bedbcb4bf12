-- KEYS: w, r   ARGV: epoch   -> {code, old reverse blob}; marks the worker "needs resync"
--#include _epoch_ok.lua
local code = epoch_state(KEYS[1], tonumber(ARGV[1]))
if code ~= OK then return {code, ''} end
redis.call('HSET', KEYS[1], 'seq', -1)
return {OK, redis.call('GET', KEYS[2]) or ''}
