-- now: the Redis clock in ms (leases and predicted entries expire by it, not by clients').
local _t = redis.call('TIME')
local now = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
