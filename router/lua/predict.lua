-- KEYS: live   ARGV: pfx, id, ttl_ms, chain   -> number of blocks written
--#include _now.lua
local pfx, code, chain = ARGV[1], struct.pack('>H', tonumber(ARGV[2])), ARGV[4]
local exp = now + tonumber(ARGV[3])
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
return n
