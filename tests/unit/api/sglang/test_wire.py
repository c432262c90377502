"""SGLang's message written without SGLang (service/api/sglang/wire.py): frame 0 is a protocol-2 pickle that
names exactly SGLang's EmbeddingData, its Modality at the path both 0.5.22 and 0.5.23 allow, and torch
dtypes, and holds nothing else but plain values. SGLang's own allow-listed unpickler on these frames:
tests/system/test_sglang.py."""

import io
import pickle
import pickletools

from service.api.sglang import wire


class _Names(pickle.Unpickler):
    """Records every global the pickle names; builds stand-ins for them."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.names = []

    def find_class(self, module, name):
        self.names.append(f"{module}.{name}")
        if module == "torch":
            return f"torch.{name}"
        if name == "Modality":
            return lambda value: ("Modality", value)
        return type(name, (), {})


def _load(frame: bytes):
    u = _Names(frame)
    return vars(u.load()), u.names


def test_a_success_frame_is_sglangs_embedding_data_with_its_fields_in_its_order():
    frames = wire.success_frames("abc_local_part_1", 3, 1, "VIDEO", [[2, 4, 6], [4, 2, 2]], "bfloat16", (10, 64),
                                 b"\x01" * 1280, [[0.5, 1.5], [0.25, 1.25, 2.25, 3.25]])
    state, names = _load(frames[0])
    assert frames[1] == b"\x01" * 1280
    assert names == ["sglang.srt.disaggregation.encoder.receiver.EmbeddingData",
                     "sglang.srt.managers.schedule_batch.Modality", "torch.bfloat16"]
    assert list(state) == ["req_id", "num_parts", "part_idx", "grid_dim", "modality", "embedding", "send_time",
                           "dtype", "shape", "_mr_ptr", "error_msg", "error_code", "video_timestamps",
                           "second_per_grid_ts"]  # copy_without_embedding()'s __dict__
    assert state == {"req_id": "abc_local_part_1", "num_parts": 3, "part_idx": 1, "grid_dim": [[2, 4, 6], [4, 2, 2]],
                     "modality": ("Modality", 2), "embedding": None, "send_time": None, "dtype": "torch.bfloat16",
                     "shape": [10, 64], "_mr_ptr": None, "error_msg": None, "error_code": None,
                     "video_timestamps": [[0.5, 1.5], [0.25, 1.25, 2.25, 3.25]], "second_per_grid_ts": None}
    assert type(state["num_parts"]) is int and type(state["part_idx"]) is int  # (SGLang refuses a bool)
    ops = {op.name for op, _, _ in pickletools.genops(frames[0])}
    assert ops <= {"PROTO", "GLOBAL", "EMPTY_TUPLE", "NEWOBJ", "EMPTY_DICT", "MARK", "SETITEMS", "BINUNICODE",
                   "BININT", "NONE", "EMPTY_LIST", "APPENDS", "BINFLOAT", "TUPLE1", "REDUCE", "BUILD", "STOP"}


def test_an_error_frame_is_frame_0_alone_with_the_message_and_an_int_code():
    (frame,) = wire.error_frames("x_local_part_0", 1, 0, "IMAGE", "mm_items[0]: not an image — é", 422)
    state, names = _load(frame)
    assert names == ["sglang.srt.disaggregation.encoder.receiver.EmbeddingData",
                     "sglang.srt.managers.schedule_batch.Modality"]
    assert state["error_msg"] == "mm_items[0]: not an image — é" and state["error_code"] == 422
    assert state["modality"] == ("Modality", 1) and state["shape"] is None and state["dtype"] is None


def test_values_of_every_size_and_kind_round_trip():
    for v in (0, -1, 2**31 - 1, -2**31, 2**31, 2**70, -2**70, 1.5e-300, "", "x" * 70000, True, False, [[]], {"a": [1]}):
        frame = wire._dumps({"v": v})
        assert _load(frame)[0] == {"v": v}
