-- The block hash and the reverse indexes keep each digest's first KEY bytes: 64 bits name
-- 20M blocks with a collision chance near 1e-5, and a collision only misroutes (the index is
-- advisory), for 8 bytes less per block and per (block, worker) entry than the full 16.
local KEY = 8
