-- A block's value packs its holders' 2-byte codes: the worker id (below 2^14) with the tier
-- it holds the block in in the top two bits (0 the device pool, 1 host memory, 2 disk).

-- worker code c at tier t (0, 1, 2)
local function tiered(c, t)
  if t == 0 then return c end
  return string.char(string.byte(c, 1) + 64 * t) .. string.sub(c, 2, 2)
end

-- the worker code of a holder code (its tier bits cleared)
local function plain(c)
  return string.char(string.byte(c, 1) % 64) .. string.sub(c, 2, 2)
end

-- is the 2-byte code among the codes packed in v (at an even offset)?
local function has(v, code)
  local p = string.find(v, code, 1, true)
  while p and p % 2 == 0 do p = string.find(v, code, p + 1, true) end
  return p ~= nil
end

-- the code the worker with code c holds a block by in v, at whatever tier, or nil
local function held_as(v, c)
  if not v then return nil end
  for t = 0, 2 do
    local tc = tiered(c, t)
    if has(v, tc) then return tc end
  end
  return nil
end
