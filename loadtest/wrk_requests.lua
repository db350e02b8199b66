-- wrk script: POST /recommend with the bodies of a request file (JSON lines), round robin.
-- RECO_REQUESTS names the file (see reco.loadtest.requests). RECO_THINK_MS, when set: each connection
-- waits an exponential time of that mean (whole ms, wrk's resolution) before each request, a light load
-- of one request at a time (bench.outside); unset: closed loop, as fast as answers come (bench.crosscheck).
local bodies = {}
for line in io.lines(os.getenv("RECO_REQUESTS")) do bodies[#bodies + 1] = line end
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", "/recommend", {["Content-Type"] = "application/json"}, bodies[i])
end
local think = tonumber(os.getenv("RECO_THINK_MS") or "")
if think then
  delay = function() return math.floor(-math.log(1 - math.random()) * think + 0.5) end
end
done = function(summary, latency, requests)
  io.write(string.format("mean_us %.3f requests %d\n", latency.mean, summary.requests))
end
