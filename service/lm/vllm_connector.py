"""vLLM's EC connector (0.33 and 0.34) for this service's store: vLLM as an LM instance (`ec_role:
ec_consumer`) takes each image's embeddings from the entries the encoder tier wrote, in a directory on this host or in
Mooncake Store across hosts, instead of running its own vision tower for them.

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "EncoderStoreConnector",
        "ec_connector_module_path": "service.lm.vllm_connector", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"store": "mooncake://MASTER:50051", "mooncake_namespace": "NS",
                                      "mooncake_local_host": "THIS_HOST"}}'

(`store` a directory: only that key; the other keys are lm/ecload.py's EntryOptions.) vLLM's connector
factory imports this module in its scheduler and worker processes; nothing in this project does, so the
service and its tests run without vLLM. vLLM's calls, per step:

    scheduler  has_cache_item(mm_hash)           found? then held (lm/ecload.py says how)
               update_state_after_alloc(req, i)  the found entries this step schedules
               build_connector_meta(out)         -> EncoderStoreMetadata, to every worker; the other
                                                    found entries are released
    worker     bind_connector_metadata(meta)
               start_load_caches(encoder_cache)  loads them into vLLM's encoder cache (mm_hash -> tensor)
               build_connector_worker_meta()     -> EncoderStoreLoaded: the holds it loaded
    scheduler  update_connector_output(out)      releases those (every worker's: vLLM merges them first)

The tensor loaded is the entry's whole `ec_cache`, [num_tokens, out_hidden * (1 + deepstack_levels)], as
ECExampleConnector loads a file of this layout: Qwen3-VL splits it into the main embeddings and the
deepstack taps itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from service.lm.ecload import EntryOptions, Held, encoder_model_for, open_entries

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EntryLoad:
    """One entry a step loads."""

    held: Held
    num_tokens: int  # the image or video tokens vLLM placed (its processor's count), checked against the entry's rows


@dataclass
class EncoderStoreMetadata(ECConnectorMetadata):
    """Scheduler -> workers, one step: the entries to load."""

    loads: list[EntryLoad] = field(default_factory=list)


@dataclass
class EncoderStoreLoaded(ECConnectorWorkerMetadata):
    """Worker -> scheduler, one step: the holds whose entries this worker has loaded (or already had)."""

    holds: set[int] = field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> EncoderStoreLoaded:
        assert isinstance(other, EncoderStoreLoaded), f"{type(other).__name__} from another connector: this is a bug"
        return EncoderStoreLoaded(self.holds | other.holds)


class EncoderStoreConnector(ECConnectorBase):
    """The consumer role of vLLM's ECConnectorBase (0.33, 0.34) over this service's store (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer:
            raise ValueError("EncoderStoreConnector reads the encoder service's entries and writes none: set "
                             "ec_role to ec_consumer (the encoder tier is `qwen3vl-encoder serve`)")
        opts = EntryOptions.from_config(dict(vllm_config.ec_transfer_config.ec_connector_extra_config))
        lm = vllm_config.model_config  # (None in a config made without a model)
        model = encoder_model_for(opts, None if lm is None else str(lm.model))
        self._entries = open_entries(opts, model)
        log.info("EncoderStoreConnector (%s): entries from %s%s, of the encoder model %s", role.name.lower(),
                 opts.store, f" in namespace {opts.mooncake_namespace}" if opts.mooncake_namespace else "",
                 model or "(any)")
        # scheduler side, for the step being scheduled:
        self._found: dict[str, Held] = {}  # mm_hash -> its entry, found (and held) at a check
        self._loads: dict[str, int] = {}  # mm_hash -> its tokens: found entries this step allocates
        # ... and across steps:
        self._sent: set[int] = set()  # holds of entries sent to the workers, not yet reported loaded
        # worker side:
        self._loaded: set[int] = set()  # holds loaded this step, for build_connector_worker_meta
        self._device: str | None = None

    # ---- scheduler side ---------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        if identifier in self._found:
            return True
        held = self._entries.hold(identifier)
        if held is None:
            return False
        self._found[identifier] = held
        return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        # NOTE: no second existence check (ECExampleConnector makes one): the entry found at this step's
        # check is held, so it is the one loaded; an input not found there is one vLLM encodes itself.
        if mm_hash in self._found:
            self._loads[mm_hash] = request.get_num_encoder_embeds(index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EncoderStoreMetadata:
        meta = EncoderStoreMetadata([EntryLoad(self._found.pop(h), n) for h, n in self._loads.items()])
        for held in self._found.values():  # found, but not scheduled this step: a later step checks again
            self._entries.release(held.hold)
        self._sent |= {load.held.hold for load in meta.loads if load.held.hold}
        self._found.clear()
        self._loads.clear()
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        loaded = connector_output.ec_connector_worker_meta
        if isinstance(loaded, EncoderStoreLoaded):
            for hold in loaded.holds & self._sent:
                self._entries.release(hold)
            self._sent -= loaded.holds

    # ---- worker side ------------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, EncoderStoreMetadata), f"{type(meta).__name__}: this is a bug"
        for load in meta.loads:
            key = load.held.key
            if key not in encoder_cache:  # (an earlier request's load, or vLLM's own encoding, put it there)
                # NOTE: nothing raises out of here: this runs in vLLM's execute_model, and an exception there
                # ends the engine core. An entry that cannot be used is left out of the encoder cache, and
                # only that request fails ("Encoder cache miss").
                try:
                    ec_cache = self._entries.load(load.held)
                except Exception as e:
                    log.error("the encoder store's entry %r was there at vLLM's check and cannot be loaded now "
                              "(%s: %s): a Mooncake host lost with its segment, an entry rewritten, or a directory "
                              "entry evicted where the scheduler's handle cannot be reached", key, type(e).__name__, e)
                    ec_cache = None
                if ec_cache is not None and ec_cache.shape[0] != load.num_tokens:
                    log.error("entry %r has %d rows where vLLM placed %d tokens: not loaded. The encoder's and "
                              "vLLM's preprocessing disagree (pixel limits; for a video, its frame sampling too: "
                              "docs/vllm.md, 'Video'); give both the same checkpoint and settings",
                              key, ec_cache.shape[0], load.num_tokens)
                    ec_cache = None
                if ec_cache is not None:
                    encoder_cache[key] = ec_cache.to(self._target_device())
            if load.held.hold:
                self._loaded.add(load.held.hold)

    def build_connector_worker_meta(self) -> EncoderStoreLoaded | None:
        if not self._loaded:
            return None
        loaded, self._loaded = EncoderStoreLoaded(self._loaded), set()
        return loaded

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        pass  # a consumer: what vLLM encodes itself stays in its own cache (the store has one writer)

    def _target_device(self) -> str:
        """Where vLLM's encoder cache lives: this worker's device (as ECExampleConnector loads)."""
        if self._device is None:
            from vllm.platforms import current_platform

            # (an unspecified platform, vLLM on a machine with no device it knows, has no device type)
            device = current_platform.device_type or "cpu"
            if current_platform.is_cuda_alike():
                device = f"{device}:{current_platform.current_device()}"
            self._device = device
        return self._device

    def shutdown(self) -> None:
        self._entries.close()
