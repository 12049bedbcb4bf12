-- KEYS: w, r   ARGV: pfx, id, epoch, removes, adds (KEY-byte keys)   -> code
--#include _epoch_ok.lua
--#include _blocks.lua
--#include _reverse.lua
local code = epoch_state(KEYS[1], tonumber(ARGV[3]))
if code ~= OK then return code end
local bkey, wcode = ARGV[1] .. 'B', code_of(ARGV[2])
local n = tonumber(redis.call('HGET', KEYS[1], 'n')) or 0
n = n - remove_blocks(bkey, wcode, ARGV[4], KEY)
local added = add_blocks(bkey, wcode, ARGV[5], KEY, wcode)
rev_append(KEYS[2], table.concat(added))
redis.call('HSET', KEYS[1], 'n', n + #added)
return OK
