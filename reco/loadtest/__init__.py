"""Load testing: Locust as its own process (runner), exact quantiles with CIs (histogram), capacity search.

from reco.loadtest.config import LoadtestConfig     # typed `loadtest` config group
from reco.loadtest.runner import run_load, run_metrics   # one load test -> LoadRun; its MLflow metrics
from reco.loadtest.capacity import find_capacity    # highest open-loop rate whose p99 CI meets an SLO
from reco.loadtest.study import run_study           # every variant, repeated and interleaved -> StudyOutcome
from reco.loadtest.requests import write_requests   # request file from the test split
"""
