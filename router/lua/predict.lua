-- KEYS: live, tails   ARGV: pfx, id, ttl_ms, exact, tail, max_tails
--   -> blocks written one key each
-- exact: the first blocks past the worker's confirmed depth (16-byte digests), one key each:
--   P.."q"..digest holds records of 2-byte id + 13-digit expiry (ms, Redis clock), PX the latest.
-- tail: '' or the sampled rest of a longer chain (_tails.lua's record less its expiry); the
--   worker keeps its max_tails newest unexpired tails (a repeat replaces its older copy).
--#include _now.lua
--#include _tails.lua
--#include _log.lua
local pfx, code, chain = ARGV[1], struct.pack('>H', tonumber(ARGV[2])), ARGV[4]
local ttl = tonumber(ARGV[3])
local exp = now + ttl
local mine = code .. string.format('%013d', exp)
local n = #chain / 16
for s = 0, n - 1, 64 do
  local keys = {}
  for j = s, math.min(n, s + 64) - 1 do
    keys[#keys + 1] = pfx .. 'q' .. string.sub(chain, j * 16 + 1, j * 16 + 16)
  end
  local vals = redis.call('MGET', unpack(keys))
  for j = 1, #keys do
    local parts, maxe, v = {mine}, exp, vals[j]
    if v then
      for k = 1, #v, 15 do
        local e = tonumber(string.sub(v, k + 2, k + 14))
        if e and string.sub(v, k, k + 1) ~= code and e > now then
          parts[#parts + 1] = string.sub(v, k, k + 14)
          if e > maxe then maxe = e end
        end
      end
    end
    redis.call('SET', keys[j], table.concat(parts), 'PX', maxe - now)
  end
end
if ARGV[5] ~= '' then
  local tkey, tail = KEYS[2], ARGV[5]
  local old = redis.pcall('HGET', tkey, code)
  if type(old) == 'table' then  -- not a hash: junk, replace it
    redis.call('DEL', tkey)
    old = false
  end
  local keep = {}
  for _, t in ipairs(parse_tails(old)) do
    if t.e > now and string.sub(t.rec, 14) ~= tail then keep[#keep + 1] = t.rec end
  end
  local first = math.max(1, #keep - tonumber(ARGV[6]) + 2)
  local parts = {}
  for k = first, #keep do parts[#parts + 1] = keep[k] end
  parts[#parts + 1] = string.format('%013d', exp) .. tail
  redis.call('HSET', tkey, code, table.concat(parts))
  if redis.call('PTTL', tkey) < ttl then redis.call('PEXPIRE', tkey, ttl) end
end
log_event(pfx, ARGV[2], 'P', struct.pack('>I4', ttl) .. chain)
return n
