-- Sampled tails of long predictions (predict.lua): the hash P.."T" maps a worker's 2-byte id to
-- its records, each 13-digit expiry (ms, Redis clock) | u32 from | u16 n | n x (u32 block
-- position from 0, ascending | 16-byte digest of the routed chain there). The chain's blocks
-- from `from` up to a sample are predicted on that worker; a chained digest equal at a position
-- is equal at every position before it, so one matching sample vouches for all of them.
-- -> {{e = expiry, from = from, n = n, at = offset of the first sample in v, rec = the record}}
-- Parsing stops at the first malformed record (junk written by someone else).
local function parse_tails(v)
  local out, pos = {}, 1
  if type(v) ~= 'string' then return out end
  while pos + 18 <= #v do
    local e = tonumber(string.sub(v, pos, pos + 12))
    local from, n = struct.unpack('>I4I2', string.sub(v, pos + 13, pos + 18))
    local stop = pos + 19 + n * 20
    if not e or stop - 1 > #v then break end
    out[#out + 1] = {e = e, from = from, n = n, at = pos + 19, rec = string.sub(v, pos, stop - 1)}
    pos = stop
  end
  return out
end
