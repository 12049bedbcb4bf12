-- KEYS: w, r   ARGV: pfx, id, epoch, seq, ops
-- ops: router.events.encode_events' op stream, records of
--      op (1 byte: S, H, D stored in the pool, host memory, on disk; R removed; C cleared)
--      | u32 BE count | count x 16-byte digests
-- -> OK (applied, or a duplicate seq), STALE_EPOCH or RESYNC_NEEDED
--#include _blocks.lua
--#include _codes.lua
--#include _reverse.lua
--#include _log.lua
local st = redis.pcall('HMGET', KEYS[1], 'epoch', 'seq', 'gc', 'n')
if st.err or not st[1] or st[3] or not tonumber(st[1]) then return RESYNC_NEEDED end
local ep, epoch = tonumber(st[1]), tonumber(ARGV[3])
if ep > epoch then return STALE_EPOCH end
if ep < epoch then return RESYNC_NEEDED end
local last, seq = tonumber(st[2]) or -1, tonumber(ARGV[4])
if last < 0 then return RESYNC_NEEDED end
if seq <= last then return OK end
if seq ~= last + 1 then
  redis.call('HSET', KEYS[1], 'seq', -1)
  return RESYNC_NEEDED
end
local bkey, code, ops, rkey = ARGV[1] .. 'B', code_of(ARGV[2]), ARGV[5], KEYS[2]
local TIERS = {S = 0, H = 1, D = 2}
local n = tonumber(st[4]) or 0
local pos, len = 1, #ops
while pos <= len do
  local op = string.sub(ops, pos, pos)
  local cnt = struct.unpack('>I4', string.sub(ops, pos + 1, pos + 4))
  local blob = string.sub(ops, pos + 5, pos + 4 + cnt * 16)
  pos = pos + 5 + cnt * 16
  if op == 'S' or op == 'H' or op == 'D' then
    local added = add_blocks(bkey, code, blob, 16, tiered(code, TIERS[op]))
    rev_append(rkey, table.concat(added))
    n = n + #added
  elseif op == 'R' then
    n = n - remove_blocks(bkey, code, blob, 16)
  elseif op == 'C' then
    remove_blocks(bkey, code, rev_all(rkey), KEY)
    rev_delete(rkey)
    n = 0
  end
end
if rev_count(rkey) > 2 * n + 1024 then
  local keep = held_blocks(bkey, code, rev_all(rkey))
  rev_set(rkey, table.concat(keep))
  n = #keep
end
redis.call('HSET', KEYS[1], 'seq', seq, 'n', n)
if #ops > 0 then log_event(ARGV[1], ARGV[2], 'O', ops) end
return OK
