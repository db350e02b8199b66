-- wrk script: POST /recommend with the bodies of a request file (JSON lines), round robin.
-- RECO_REQUESTS names the file (see reco.loadtest.requests).
local bodies = {}
for line in io.lines(os.getenv("RECO_REQUESTS")) do bodies[#bodies + 1] = line end
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", "/recommend", {["Content-Type"] = "application/json"}, bodies[i])
end
