-- KEYS: live, load, rv, lv   ARGV: pfx, chain (16-byte digests), the caller's load version
-- -> {rv, live 2-byte ids, per worker that matched anything: 2-byte id | u32 confirmed |
--     u32 predicted, lv, loads of the live workers in order (nil when lv is the caller's),
--     blocks walked}
-- Walks block by block and stops at the first block no live worker matched (confirmed or
-- predicted). Blocks are read in HMGET chunks of 8, 16, 32, 64, 64, ... so it reads at most one
-- chunk past that block; predicted keys are read only where a worker still walking has no
-- confirmed entry (typically one chunk at the end of the walk).
--#include _now.lua
local pfx, chain = ARGV[1], ARGV[2]
local bkey = pfx .. 'B'
local live = {}
for _, c in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  if #c == 2 then live[#live + 1] = c end  -- anything else is junk, not a worker
end
local nblocks = #chain / 16
local dc, dp, ac, au = {}, {}, {}, {}
local nu = #live
for _, c in ipairs(live) do
  ac[c] = true
  au[c] = true
end
local mark, pmark = {}, {}
local walked, i, chunk = 0, 0, 8
local prev, clean = nil, false  -- last block's value; clean: every walker was confirmed there
while nu > 0 and i < nblocks do
  local last = math.min(nblocks, i + chunk)
  local fields = {}
  for j = i + 1, last do
    fields[#fields + 1] = string.sub(chain, (j - 1) * 16 + 1, j * 16)
  end
  local vb = redis.call('HMGET', bkey, unpack(fields))
  local vq, qbase = nil, 0
  for j = i + 1, last do
    walked = j
    local v = vb[j - i]
    -- Fast path: the same holders as the last block, where every walker was confirmed, so
    -- every walker goes on. A worker's depth is only written when it drops out.
    if not (clean and v == prev) then
      if v then
        for k = 1, #v, 2 do mark[string.sub(v, k, k + 1)] = j end
      end
      -- predicted entries matter only for a walker without a confirmed entry here
      local need = false
      for c in pairs(au) do
        if mark[c] ~= j then
          need = true
          break
        end
      end
      if need then
        if not vq then
          local qkeys = {}
          for jj = j, last do qkeys[#qkeys + 1] = pfx .. 'q' .. fields[jj - i] end
          vq, qbase = redis.call('MGET', unpack(qkeys)), j - 1
        end
        local q = vq[j - qbase]
        if q then
          for k = 1, #q, 15 do
            local e = tonumber(string.sub(q, k + 2, k + 14))
            if e and e > now then
              pmark[string.sub(q, k, k + 1)] = j
            end
          end
        end
      end
      for c in pairs(au) do
        if mark[c] ~= j and pmark[c] ~= j then
          au[c] = nil
          nu = nu - 1
          if j > 1 then dp[c] = j - 1 end
        end
      end
      for c in pairs(ac) do
        if mark[c] ~= j then
          ac[c] = nil
          if j > 1 then dc[c] = j - 1 end
        end
      end
      prev, clean = v, not need
    end
    if nu == 0 then break end
  end
  i = last
  chunk = math.min(chunk * 2, 64)
end
for c in pairs(au) do dp[c] = walked end
for c in pairs(ac) do dc[c] = walked end
local recs = {}
for c, d in pairs(dp) do recs[#recs + 1] = c .. struct.pack('>I4I4', dc[c] or 0, d) end
local lv = redis.call('GET', KEYS[4]) or '0'
local loads = false
if lv ~= ARGV[3] and #live > 0 then loads = redis.call('HMGET', KEYS[2], unpack(live)) end
return {redis.call('GET', KEYS[3]) or '0', table.concat(live), table.concat(recs), lv, loads,
        walked}
