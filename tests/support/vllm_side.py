"""A stand-in for one vLLM process (0.33 or 0.34: tests/support/vllm_env.py's VERSIONS), for tests that drive vLLM's own EC connector calls on the CPU:
`VllmSide` runs this file as a subprocess on vLLM's environment (tests/support/vllm_env.py) and sends it one
call at a time, so that a test can act between two of vLLM's calls (evict an entry between the
scheduler's check and the worker's load, say). A scheduler and a worker are two of them, as in vLLM:
what crosses between them is the connector metadata, pickled as vLLM's executor sends it.

The connectors are made by vLLM's own factory from a VllmConfig with only the EC transfer config (no
model, no engine); the requests are vLLM's own `Request`s with image features; the encoder cache is a
plain dict, as vLLM's model runner's is. Each reply is one line `@@ <json>` on stdout (vLLM logs there
too); a call that raises answers {"error": "Type: message"}.

Not a test module: the test process imports only `VllmSide` (no vLLM); the subprocess runs `main`.
"""

from __future__ import annotations

import base64
import pickle
from pathlib import Path

from tests.support.side import SideProcess, serve



class VllmSide(SideProcess):
    """One vLLM-side process. `call(op, **args)` -> its reply (a dict); see `main` for the ops."""

    WHAT = "vLLM-side"

    def __init__(self, env: dict[str, str], log: Path):
        super().__init__(__file__, env, log)


def _b64(obj) -> str | None:
    return None if obj is None else base64.b64encode(pickle.dumps(obj)).decode()


def _unb64(text: str | None):
    return None if text is None else pickle.loads(base64.b64decode(text))


def main() -> None:
    import safetensors.torch
    from vllm import SamplingParams
    from vllm.config import DeviceConfig, ECTransferConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    # NOTE: no platform is detected here (no GPU vLLM knows, and not vLLM's CPU build): vLLM's own connector
    # would load onto current_platform.device_type, which is "" then. The platform of a CPU deployment.
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    connectors, caches, requests = {}, {}, {}

    def connector(name, role, ec_connector, extra, module=None):
        """vLLM's factory makes it, as the scheduler and each worker do at start."""
        cfg = ECTransferConfig(ec_connector=ec_connector, ec_connector_module_path=module, ec_role="ec_consumer",
                               ec_connector_extra_config=extra)
        # NOTE: a device given, for no platform is detected here (no GPU vLLM knows); nothing runs on it.
        vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"), ec_transfer_config=cfg)
        connectors[name] = ECConnectorFactory.create_connector(vllm_config, ECConnectorRole[role.upper()])
        caches[name] = {}  # the worker's encoder cache: mm_hash -> tensor
        return {"class": type(connectors[name]).__module__ + "." + type(connectors[name]).__name__}

    def has(name, mm_hash):
        return {"found": connectors[name].has_cache_item(mm_hash)}

    def alloc(name, request_id, images, index):
        """update_state_after_alloc for input `index` of a request whose images are [[mm_hash, tokens], ...],
        placed one after another in its prompt."""
        if request_id not in requests:
            features, offset = [], 1
            for mm_hash, tokens in images:
                features.append(MultiModalFeatureSpec(data=None, modality="image", identifier=mm_hash,
                                                      mm_position=PlaceholderRange(offset=offset, length=tokens)))
                offset += tokens + 1
            requests[request_id] = Request(request_id, [0] * (offset + 1), SamplingParams(max_tokens=1), None,
                                           mm_features=features)
        connectors[name].update_state_after_alloc(requests[request_id], index)
        return {}

    def meta(name):
        return {"meta": _b64(connectors[name].build_connector_meta(SchedulerOutput.make_empty()))}

    def load(name, meta, out):
        """One model step's connector part on a worker (vLLM's ECConnectorModelRunnerMixin): bind, load into
        the encoder cache, the worker metadata, clear; the cache is saved to `out`."""
        c, cache = connectors[name], caches[name]
        c.bind_connector_metadata(_unb64(meta))
        try:
            c.start_load_caches(cache)
        finally:
            worker_meta = c.build_connector_worker_meta()
            c.clear_connector_metadata()
        safetensors.torch.save_file({k: v.contiguous() for k, v in cache.items()}, out)
        return {"keys": sorted(cache), "worker_meta": _b64(worker_meta)}

    def output(name, worker_meta):
        connectors[name].update_connector_output(ECConnectorOutput(ec_connector_worker_meta=_unb64(worker_meta)))
        return {}

    def vllm_mooncake_read(master, keys, specs, out):
        """vLLM 0.33's own reading of Mooncake embedding values (its encoder-side store client's
        load_tensors: header checked against the expected shape and dtype), on a client of ours."""
        from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import TensorSpec
        from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client import (
            MooncakeEmbeddingStoreClient,
        )

        from service.store.options import MOONCAKE_BUFFER_BYTES, MooncakeOptions, parse_mooncake
        from service.store.pool import connect

        client = connect(MooncakeOptions(master=parse_mooncake(master), local_host="127.0.0.1", segment_bytes=0,
                                         buffer_bytes=MOONCAKE_BUFFER_BYTES, protocol="tcp", namespace=None))
        reader = MooncakeEmbeddingStoreClient(client)
        try:
            got = reader.load_tensors({k: TensorSpec(tuple(s), f"torch.{d}", n) for k, (s, d, n) in zip(keys, specs)},
                                      "cpu")
        finally:
            reader.close()
        safetensors.torch.save_file(got, out)
        return {"keys": sorted(got)}

    def shutdown(name):
        connectors.pop(name).shutdown()
        return {}

    def mm_hash(model, data, algorithm="blake3"):
        """vLLM's own key of an image (what its LM computes from the request: its hasher over the item its
        image loader made of the bytes)."""
        from vllm.multimodal.hasher import MultiModalHasher
        from vllm.multimodal.media.image import ImageMediaIO

        item = ImageMediaIO().load_bytes(base64.b64decode(data))
        return {"mm_hash": MultiModalHasher.hash_kwargs(algorithm, model_id=model, image=item)}

    def version():
        import vllm

        return {"version": vllm.__version__}

    ops = {f.__name__: f for f in (connector, has, alloc, meta, load, output, vllm_mooncake_read, shutdown, mm_hash,
                                   version)}
    serve(ops)


if __name__ == "__main__":
    main()
