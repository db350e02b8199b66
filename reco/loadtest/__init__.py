"""Load testing: Locust as its own process (runner), exact percentiles (histogram), capacity search.

from reco.loadtest.runner import run_load          # one load test -> LoadResult
from reco.loadtest.capacity import find_capacity   # highest open-loop rate at a p99 SLO
from reco.loadtest.requests import write_requests  # request file from the test split
"""
