"""serve.backend=triton (entry point: python -m reco.cli.triton_server --variant DIR --dataset PATH.pt ...)

serve.backend=triton: the variant served by Triton Inference Server through PyTriton. The variant's request
pipeline -- parse, candidates, features, model, top-k (reco/serve/recommend.py, the code reco's own server
runs) -- is bound as one Triton model, `serve.triton.model_name`, with

    input  "request"   BYTES [1]  a /recommend JSON body, as reco's server takes it
    output "response"  BYTES [1]  the JSON reco's server answers; for a request it would refuse with a
                                  4xx: {"error", "field", "status"} (Triton answers the HTTP call 200)

answered over Triton's HTTP/REST (KServe v2) protocol on serve.host:serve.port only (gRPC and the metrics
port are off):

    POST /v2/models/reco/infer
    {"inputs": [{"name": "request", "shape": [1, 1], "datatype": "BYTES", "data": ["{\\"user_id\\": 7, \\"k\\": 10}"]}]}

Triton queues the requests; with serve.batching.enabled (or the variant's runtime.batching) its dynamic
batcher hands an instance up to triton.max_batch_size requests at once (aiming for
triton.preferred_batch_sizes, waiting at most batching.max_queue_delay_ms), and the instance scores all
their candidates in ONE model call. triton.instances instances run at once (Triton's instance_group
count), each in its own thread of this process with its own scratch; the tables and the scorer are shared.

Run it with the interpreter of `.venv-triton` (`make triton-venv`): PyTriton's Python-backend stub links
the system libpython3.11, and under another 3.11 build model loading fails. Settings compose as for
`python -m reco.cli.serve`; the process refuses to start (reason on stderr, exit code 2) when they, the
variant, the port, the interpreter or PyTriton are not usable. SIGTERM/SIGINT stop tritonserver and exit 0.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import sys
from dataclasses import dataclass

import numpy as np
import orjson

from reco.serve.config import ServeConfig
from reco.serve.recommend import Loaded, candidate_items, load_variant, response_body, top_k
from reco.serve.request import Request, RequestError, request_schema

log = logging.getLogger("reco.serve")

INPUT, OUTPUT = "request", "response"
SYSTEM_PREFIX = "/usr"  # the system interpreter's prefix: the libpython the Python-backend stub links
MODEL_NAME = re.compile(r"^[a-zA-Z0-9._-]+$")  # what Triton accepts as a model name


class TritonStartError(RuntimeError):
    """The Triton backend cannot start (its message names the setting at fault)."""


@dataclass
class _Work:
    """One request body of a batch that parsed: where its answer goes and its model input."""

    slot: int  # index of its answer in the flat list of the batch's bodies
    req: Request
    items: np.ndarray  # [M] int64
    block: tuple[np.ndarray, np.ndarray, np.ndarray]  # dense [M, D], ids [M, F, L], mask [M, F, L]


def error_body(e: RequestError) -> bytes:
    """The answer for a body reco's server refuses: {"error", "field", "status"} (status: its HTTP code)."""
    return orjson.dumps({"error": e.message, "field": e.field, "status": e.status})


class RecoModel:
    """One Triton model instance: the variant's request pipeline over a batch of Triton requests."""

    def __init__(self, loaded: Loaded, cfg: ServeConfig) -> None:
        """Args:
        loaded: the variant (shared by every instance; the scorer is safe to call from several threads).
        cfg: the serve settings (n_candidates, max_k, max_candidates, max_body_bytes).
        """
        self.name, self.scorer, self.cfg = loaded.name, loaded.scorer, cfg
        self.store = loaded.store.for_thread()
        self.request_schema = request_schema(self.store, cfg.max_k, cfg.max_candidates)

    def __call__(self, requests: list) -> list[dict[str, np.ndarray]]:
        """Answer a batch: PyTriton's requests (each {"request": [b, 1] bytes}) -> one {"response": [b, 1]}
        per request, in order. All bodies' candidates are scored in one model call."""
        bodies = [np.asarray(r[INPUT]).reshape(-1) for r in requests]
        flat = [b for arr in bodies for b in arr.tolist()]
        answers: list[bytes] = [b""] * len(flat)
        work = self._prepare(flat, answers)
        scored = [w for w in work if len(w.items)]
        probs = self._score([w.block for w in scored])
        for w in work:
            p = probs.pop(0) if len(w.items) else np.empty(0, dtype=np.float32)
            ids, scores = top_k(self.name, w.items, p, w.req.k)
            answers[w.slot] = response_body(self.name, ids, scores)
        out, at = [], 0
        for arr in bodies:
            out.append({OUTPUT: np.array(answers[at : at + len(arr)], dtype=object).reshape(-1, 1)})
            at += len(arr)
        return out

    def _prepare(self, flat: list, answers: list[bytes]) -> list[_Work]:
        """Parse each body and build its model input; refused ones get their error answer now."""
        cfg, store = self.cfg, self.store
        work = []
        for slot, body in enumerate(flat):
            try:
                body = body if isinstance(body, bytes) else str(body).encode()
                if len(body) > cfg.max_body_bytes:
                    raise RequestError(413, "body", f"body: {len(body)} bytes, at most {cfg.max_body_bytes}")
                req = self.request_schema.parse(body)
            except RequestError as e:
                answers[slot] = error_body(e)
                continue
            urow = store.user_row(req.user_id)
            items = candidate_items(store, urow, req, cfg.n_candidates)
            work.append(_Work(slot, req, items, store.assemble(urow, req, items)))
        return work

    def _score(self, blocks: list[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
        """One model call over the blocks' rows, split back per block."""
        if not blocks:
            return []
        sizes = [len(b[0]) for b in blocks]
        if len(blocks) == 1:
            return [self.scorer(*blocks[0], sizes)]
        probs = self.scorer(*(np.concatenate(parts) for parts in zip(*blocks, strict=True)), sizes)
        cuts = np.cumsum(sizes)[:-1]
        return list(np.split(probs, cuts))


def check_environment(cfg: ServeConfig) -> None:
    """Refuse an interpreter the Python-backend stub cannot load models under, or one without PyTriton.

    Args:
        cfg: the serve settings (named in the message).
    Raises:
        TritonStartError naming serve.triton.python and `make triton-venv`.
    """
    fix = "build it with `make triton-venv` (a venv of /usr/bin/python3.11 with nvidia-pytriton)"
    if os.path.realpath(sys.base_prefix) != SYSTEM_PREFIX:
        raise TritonStartError(
            f"serve.triton.python={cfg.triton.python}: {sys.executable} is a Python from {sys.base_prefix}, "
            f"not the system interpreter (prefix {SYSTEM_PREFIX}); PyTriton's Python-backend stub links the "
            f"system libpython3.11 and fails to load models under another build; {fix}"
        )
    try:
        import pytriton.triton  # noqa: F401
    except ImportError as e:
        raise TritonStartError(
            f"serve.triton.python={cfg.triton.python}: PyTriton cannot be imported in {sys.executable} ({e}); "
            f"{fix}"
        ) from None
    if not MODEL_NAME.match(cfg.triton.model_name):
        raise TritonStartError(
            f"serve.triton.model_name: expected letters, digits, '.', '_' or '-', got {cfg.triton.model_name!r}"
        )


def check_port(host: str, port: int) -> None:
    """Refuse a port something already listens on (tritonserver would fail after the model loaded).

    Raises:
        TritonStartError naming serve.port / serve.host.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise TritonStartError(
                f"serve.port={port}: {host}:{port} {why}; pick another serve.port (or serve.host)"
            ) from None


# PyTriton ships its proxy (model.py, communication.py) to Triton with every model it loads. There, each
# instance after the first fetches its config from the first one's handshake server, giving it 1 s,
# hard-coded, to create its socket, and connecting once. Instances start at once, so on a busy machine
# the socket may not exist yet ("Timeout occurred while waiting for config file ...-config.sock"), or be
# bound but not listening (ConnectionRefusedError), and the model never loads (seen in CI: CHANGELOG.md).
# The shipped copy waits HANDSHAKE_WAIT_S and retries a refused connect until then. Upstream: PyTriton
# 0.7.0 (triton-inference-server/pytriton); no upstream issue covers it (its tracker searched, none
# found): remove this patch once PyTriton's handshake waits for the first instance.
HANDSHAKE_WAIT_S = 60.0
HANDSHAKE_PATCHES = (
    (
        b"def get_config_from_handshake_server(socket_path: pathlib.Path, timeout_s: float = 1.0)",
        f"def get_config_from_handshake_server(socket_path: pathlib.Path, timeout_s: float = {HANDSHAKE_WAIT_S})",
    ),
    (
        b"""        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.0, should_stop_before_s - time.time()))
        sock.connect(socket_path.as_posix())
""",
        """        while True:  # reco: the first instance binds its socket before it listens on it
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(0.0, should_stop_before_s - time.time()))
            try:
                sock.connect(socket_path.as_posix())
                break
            except ConnectionRefusedError:
                sock.close()
                sock = None
                if time.time() >= should_stop_before_s:
                    raise
                time.sleep(0.01)
""",
    ),
)


def patient_handshake() -> None:
    """Make the proxy code PyTriton ships wait for, and retry, an instance's handshake (see above). A
    PyTriton whose code no longer holds what is patched is left as it is, with a warning."""
    from pytriton.models.model import Model

    ship = Model.get_proxy_model_files
    if getattr(ship, "patient", False):
        return

    def files(self) -> dict[str, bytes]:
        out = ship(self)
        for name, code in out.items():
            if not name.endswith("/communication.py"):
                continue
            for old, new in HANDSHAKE_PATCHES:
                if old not in code:
                    log.warning("PyTriton's handshake code changed; %s shipped without this patch", name)
                    continue
                code = code.replace(old, new if isinstance(new, bytes) else new.encode())
            out[name] = code
        return out

    files.patient = True  # type: ignore[attr-defined]
    Model.get_proxy_model_files = files


def bind_model(triton, loaded: Loaded, cfg: ServeConfig) -> None:
    """Bind the request pipeline as Triton model `cfg.triton.model_name` (instances, dynamic batcher).

    Args:
        triton: the pytriton.triton.Triton to bind to.
        loaded: the variant.
        cfg: the serve settings.
    """
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    t = cfg.triton
    batcher = (
        DynamicBatcher(
            max_queue_delay_microseconds=round(loaded.batching.max_queue_delay_ms * 1000),
            preferred_batch_size=list(t.preferred_batch_sizes) or None,
        )
        if loaded.batching.enabled
        else None  # Triton's default scheduler: every request is its own execution
    )
    triton.bind(
        model_name=t.model_name,
        infer_func=[RecoModel(loaded, cfg) for _ in range(t.instances)],
        inputs=[Tensor(name=INPUT, dtype=bytes, shape=(1,))],
        outputs=[Tensor(name=OUTPUT, dtype=bytes, shape=(1,))],
        config=ModelConfig(batching=True, max_batch_size=t.max_batch_size, batcher=batcher),
        strict=False,
    )


def triton_config(cfg: ServeConfig):
    """PyTriton's TritonConfig: HTTP on serve.host:serve.port only, no gRPC, no metrics port.

    Returns:
        A pytriton.triton.TritonConfig.
    """
    from pytriton.triton import TritonConfig

    return TritonConfig(
        http_address=cfg.host,
        http_port=cfg.port,
        http_thread_count=cfg.triton.http_threads,
        allow_grpc=False,
        allow_metrics=False,
        allow_gpu_metrics=False,
        allow_cpu_metrics=False,
        exit_on_error=True,
        exit_timeout_secs=5,  # in-flight requests at shutdown; ServerHandle.stop SIGKILLs after 10 s
        log_verbose=0,
    )


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)  # unwinds through Triton's context manager, which stops tritonserver


def serve(variant_dir: str, dataset_path: str, cfg: ServeConfig) -> int:
    """Serve the variant from Triton until SIGTERM/SIGINT (entry point: python -m reco.cli.triton_server).

    Returns:
        0 after a requested stop, 1 when tritonserver died, 2 when it could not start.
    """
    from reco.serve.server import run_stoppable

    return run_stoppable(lambda: _run(variant_dir, dataset_path, cfg), _stop)


def _run(variant_dir: str, dataset_path: str, cfg: ServeConfig) -> int:
    from reco.serve.features import ServeConfigError
    from reco.variant import ArtifactError

    try:
        logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
        check_environment(cfg)
        check_port(cfg.host, cfg.port)
        if cfg.cpu_affinity:
            os.sched_setaffinity(0, cfg.cpu_affinity)  # tritonserver and its stubs inherit it
        loaded = load_variant(variant_dir, dataset_path, cfg)
    except (
        TritonStartError,
        ServeConfigError,
        ArtifactError,
        OSError,
        KeyError,
        ValueError,
    ) as e:
        print(f"reco.serve.triton_backend: cannot start: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from pytriton.triton import DEFAULT_PROTECTED_ENDPOINTS, Triton, TritonSecurityConfig

    from reco.serve.keepwarm import start_keep_warm, stop_keep_warm

    spinners = start_keep_warm(sorted(os.sched_getaffinity(0))) if cfg.keep_warm else []
    try:
        # PyTriton guards the statistics endpoint with a random token by default; the load runner reads it
        # (reco.loadtest.triton_stats), and the server listens on serve.host only. The rest stays guarded.
        open_stats = TritonSecurityConfig(
            restricted_endpoints=[e for e in DEFAULT_PROTECTED_ENDPOINTS if e != "statistics"]
        )
        patient_handshake()
        with Triton(config=triton_config(cfg), security_config=open_stats) as triton:
            bind_model(triton, loaded, cfg)
            try:
                triton.run()
            except Exception as e:  # PyTriton raises its own types (timeouts, validation, server exit)
                print(
                    f"reco.serve.triton_backend: cannot start: serve.backend=triton: tritonserver did not "
                    f"serve model {cfg.triton.model_name!r} on {cfg.host}:{cfg.port}: {type(e).__name__}: {e}",
                    file=sys.stderr,
                )
                return 2
            print(f"reco.serve.triton_backend: serving {loaded.name!r} on {cfg.host}:{cfg.port}", flush=True)
            triton.serve()  # returns when tritonserver or a model instance dies
        print("reco.serve.triton_backend: tritonserver stopped on its own", file=sys.stderr)
        return 1
    finally:
        stop_keep_warm(spinners)
