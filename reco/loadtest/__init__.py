"""Load testing: Locust as its own process (runner), exact quantiles with CIs (histogram), capacity search.

from reco.loadtest.config import LoadtestConfig     # typed `loadtest` config group
from reco.loadtest.runner import run_load          # one load test -> LoadRun
from reco.loadtest.runs import run_metrics         # a LoadRun's MLflow metrics (README names + CI bounds)
from reco.loadtest.capacity import find_capacity    # highest open-loop rate whose p99 CI meets an SLO
from reco.loadtest.study import run_study           # every variant, repeated and interleaved -> StudyOutcome
from reco.loadtest.requests import write_requests   # request file from the test split
"""
