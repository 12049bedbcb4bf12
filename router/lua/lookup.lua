-- KEYS: live, load, rv, lv, tails, lz   ARGV: pfx, chain (16-byte digests), the caller's load
--   version ('' for none)
-- -> {rv, per live worker holding block 1: 2-byte id | u32 confirmed | u32 predicted, lv,
--     {2-byte id, load, ...} of the loads changed since the caller's version, 1 when that is
--     every load (the caller's version is unknown here), blocks walked}
-- Walks block by block and stops at the first block no live worker matched (confirmed or
-- predicted). Only the workers holding block 1 (confirmed, predicted, or by a tail) walk, and
-- only their leases are read, so a lookup costs what the chain's holders cost, not what the
-- fleet does. Blocks are read in HMGET chunks of 8, 16, 32, 64, 64, ... so it reads at most one
-- chunk past that block; predicted keys are read only where a worker still walking has no
-- confirmed entry (typically one chunk at the end of the walk). A worker that matched neither
-- may still ride a sampled tail of a long prediction (_tails.lua) up to its last sample that
-- matches the chain; while every walker rides one, the walk skips ahead.
--#include _now.lua
--#include _tails.lua
--#include _key.lua
local pfx, chain = ARGV[1], ARGV[2]
local bkey = pfx .. 'B'
local live, cand = {}, {}
if #chain >= 16 then
  local v = redis.call('HGET', bkey, string.sub(chain, 1, KEY))
  if v then
    for k = 1, #v, 2 do cand[string.sub(v, k, k + 1)] = true end
  end
  local q = redis.call('GET', pfx .. 'q' .. string.sub(chain, 1, 16))
  if q then
    for k = 1, #q, 15 do cand[string.sub(q, k, k + 1)] = true end
  end
  if redis.call('EXISTS', KEYS[5]) == 1 then  -- workers with a sampled tail (few, if any)
    local holders = redis.pcall('HKEYS', KEYS[5])
    if not holders.err then
      for _, c in ipairs(holders) do cand[c] = true end
    end
  end
end
local ncand = 0
for _ in pairs(cand) do ncand = ncand + 1 end
if ncand > 32 then  -- a popular first block: one read of every lease beats a call per holder
  for _, c in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
    if cand[c] and #c == 2 then live[#live + 1] = c end
  end
else
  for c in pairs(cand) do
    if #c == 2 then  -- anything else is junk, not a worker
      local lease = redis.call('ZSCORE', KEYS[1], c)
      if lease and tonumber(lease) >= now then live[#live + 1] = c end
    end
  end
end
local nblocks = #chain / 16
local dc, dp, ac, au = {}, {}, {}, {}
local nu = #live
for _, c in ipairs(live) do
  ac[c] = true
  au[c] = true
end
local mark, pmark, cover = {}, {}, {}  -- cover: the last block a tail carries a walker to
local tails, parsed = nil, {}  -- worker -> its tails, read on the first need; parsed on use

-- the last block (from 1) of the chain that a tail of worker c carries it to from block j, or 0
local function reach(c, j)
  if not tails then
    tails = {}
    if redis.call('EXISTS', KEYS[5]) == 1 then  -- usually not: no long prompt routed lately
      local vals = redis.pcall('HMGET', KEYS[5], unpack(live))
      if not vals.err then
        for k, w in ipairs(live) do tails[w] = vals[k] end
      end
    end
  end
  local v, best = tails[c], 0
  if not v then return 0 end
  parsed[c] = parsed[c] or parse_tails(v)
  for _, t in ipairs(parsed[c]) do
    if t.e > now and t.from < j then
      for k = 0, t.n - 1 do
        local at = t.at + k * 20
        local p = struct.unpack('>I4', string.sub(v, at, at + 3))
        if p >= nblocks then break end
        if p >= j - 1 then
          if string.sub(chain, p * 16 + 1, p * 16 + 16) ~= string.sub(v, at + 4, at + 19) then
            break
          end
          if p + 1 > best then best = p + 1 end
        end
      end
    end
  end
  return best
end

local walked, i, chunk = math.min(nblocks, 1), 0, 8
local prev, clean = nil, false  -- last block's value; clean: every walker was confirmed there
while nu > 0 and i < nblocks do
  local last = math.min(nblocks, i + chunk)
  local fields = {}  -- the block-hash keys: each digest's first KEY bytes
  for j = i + 1, last do
    fields[#fields + 1] = string.sub(chain, (j - 1) * 16 + 1, (j - 1) * 16 + KEY)
  end
  local vb = redis.call('HMGET', bkey, unpack(fields))
  local vq, qbase = nil, 0
  local skip = nil
  for j = i + 1, last do
    walked = j
    local v = vb[j - i]
    -- Fast path: the same holders as the last block, where every walker was confirmed, so
    -- every walker goes on. A worker's depth is only written when it drops out.
    if not (clean and v == prev) then
      if v then
        for k = 1, #v, 2 do mark[string.sub(v, k, k + 1)] = j end
      end
      -- predicted entries matter only for a walker without a confirmed entry or a tail here
      local need, confirmed = false, true
      for c in pairs(au) do
        if mark[c] ~= j then
          confirmed = false
          if (cover[c] or 0) < j then
            need = true
            break
          end
        end
      end
      if need then
        if not vq then
          local qkeys = {}
          for jj = j, last do  -- predicted keys carry the whole digest
            qkeys[#qkeys + 1] = pfx .. 'q' .. string.sub(chain, (jj - 1) * 16 + 1, jj * 16)
          end
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
        if mark[c] ~= j and pmark[c] ~= j and (cover[c] or 0) < j then
          local r = reach(c, j)
          if r >= j then
            cover[c] = r
          else
            au[c] = nil
            nu = nu - 1
            if j > 1 then dp[c] = j - 1 end
          end
        end
      end
      for c in pairs(ac) do
        if mark[c] ~= j then
          ac[c] = nil
          if j > 1 then dc[c] = j - 1 end
        end
      end
      prev, clean = v, confirmed
      -- no confirmed walk left and every walker rides a tail past here: skip to its end
      if nu > 0 and next(ac) == nil then
        local low = nblocks
        for c in pairs(au) do low = math.min(low, cover[c] or 0) end
        if low > j then
          skip = low
          break
        end
      end
    end
    if nu == 0 then break end
  end
  if skip then
    walked, i, chunk = skip, skip, 8
    prev, clean = nil, false
  else
    i = last
    chunk = math.min(chunk * 2, 64)
  end
end
for c in pairs(au) do dp[c] = walked end
for c in pairs(ac) do dc[c] = walked end
local recs = {}
for c, d in pairs(dp) do recs[#recs + 1] = c .. struct.pack('>I4I4', dc[c] or 0, d) end
local lv = redis.call('GET', KEYS[4]) or '0'
local mine, all = tonumber(ARGV[3]), 0
local changed = {}
if not mine or not tonumber(lv) or mine > tonumber(lv) then  -- no version, or a reset store
  changed, all = redis.call('HGETALL', KEYS[2]), 1
elseif mine < tonumber(lv) then
  local ids = redis.call('ZRANGEBYSCORE', KEYS[6], '(' .. ARGV[3], '+inf')
  if #ids > 0 then
    local vals = redis.call('HMGET', KEYS[2], unpack(ids))
    for k, c in ipairs(ids) do
      changed[#changed + 1] = c
      changed[#changed + 1] = vals[k]
    end
  end
end
return {redis.call('GET', KEYS[3]) or '0', table.concat(recs), lv, changed, all, walked}
