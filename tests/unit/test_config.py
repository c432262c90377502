"""One config object: CLI flags and QVE_* environment variables, a flag winning, validated."""

import pytest
from pydantic import ValidationError

from service.__main__ import build_parser, main
from service.config import Settings, default_api_processes


def _from_cli(*argv):
    args = vars(build_parser().parse_args(["serve", *argv]))
    args.pop("command")
    return Settings(**args)


def test_every_setting_is_a_flag_and_an_env_var(monkeypatch):
    monkeypatch.setenv("QVE_MAX_BATCH_TOKENS", "1234")
    monkeypatch.setenv("QVE_ALLOWED_URL_HOSTS", "Images.Example.com, cdn.example.org")
    monkeypatch.setenv("QVE_PORT", "9001")
    monkeypatch.setenv("QVE_WARMUP", "false")
    s = _from_cli("--port", "9002", "--model", "tiny", "--max-wait-ms", "2.5")
    assert s.port == 9002  # the flag wins over QVE_PORT
    assert s.max_batch_tokens == 1234 and s.warmup is False
    assert s.allowed_url_hosts == ["images.example.com", "cdn.example.org"]
    assert s.model == "tiny" and s.max_wait_ms == 2.5
    flags = {a.option_strings[0] for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions
             if a.option_strings and a.option_strings[0] != "-h"}
    assert {"--" + f.replace("_", "-") for f in Settings.model_fields} <= flags
    assert _from_cli("--no-warmup").warmup is False


def test_defaults_work_out_of_the_box(monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith("QVE_"):
            monkeypatch.delenv(k)
    s = Settings()
    assert s.host == "127.0.0.1" and s.model == "qwen3-vl-2b" and s.device == "auto"
    assert str(s.store).endswith("qwen3vl-encoder-cache")
    assert s.resolved_dtype() in ("float32", "bfloat16")


@pytest.mark.parametrize("bad", [
    {"device": "tpu"}, {"device": "cuda:x"}, {"dtype": "float16"}, {"port": 70000}, {"pool_slots": 1},
    {"max_batch_tokens": 0}, {"min_pixels": 10, "max_pixels": 5}, {"no_such_setting": 1},
])
def test_invalid_settings_are_refused(bad):
    with pytest.raises(ValidationError):
        Settings(**bad)


def test_cli_reports_invalid_settings(capsys):
    assert main(["serve", "--device", "tpu"]) == 2
    assert "device must be cpu, cuda, cuda:N or auto" in capsys.readouterr().err


def test_list_settings_take_comma_separated_values(monkeypatch):
    assert _from_cli("--graph-exact-sides", "448,640").graph_exact_sides == [448, 640]
    assert Settings().graph_exact_sides == [448, 512]
    monkeypatch.setenv("QVE_GRAPH_EXACT_SIDES", "")
    assert Settings().graph_exact_sides == []  # none: every step pads to the dense ladder
    with pytest.raises(ValidationError):
        Settings(graph_exact_sides="448,big")


def test_queue_bounds_reach_the_batcher():
    limits = Settings(max_queue_images=7, max_queue_tokens=1234).engine_options().limits
    assert (limits.max_queue_images, limits.max_queue_tokens) == (7, 1234)
    assert Settings().max_queue_tokens == 65536


def test_each_part_gets_its_options_derived_from_the_settings_once():
    from pathlib import Path

    from service.store.options import MOONCAKE_BUFFER_BYTES, MooncakeOptions, StoreOptions
    from service.config import BatchLimits, FaultInjection, RunnerOptions

    s = _from_cli("--max-batch-tokens", "2048", "--max-batch-images", "12", "--max-wait-ms", "7", "--pool-slots", "4",
                  "--no-cuda-graphs", "--graph-max-patches", "4096", "--graph-exact-sides", "448,512", "--graph-exact-images", "24", "--no-compile",
                  "--attention", "fa3",
                  "--compile-cache", "/tmp/cc", "--store", "/tmp/st", "--store-capacity-bytes", "1000",
                  "--store-group", "video", "--store-min-residency-s", "9", "--store-writers", "2",
                  "--max-queue-images", "5", "--max-queue-tokens", "99")
    assert s.batch_limits() == BatchLimits(max_batch_tokens=2048, max_batch_images=12, max_wait_s=0.007,
                                           max_queue_images=5, max_queue_tokens=99)
    faults = FaultInjection(stall_cycles=5)
    assert s.runner_options(faults) == RunnerOptions(
        max_batch_tokens=2048, max_batch_images=12, pool_slots=4, cuda_graphs=False, graph_max_patches=4096,
        graph_exact_sides=(448, 512), graph_exact_images=24, compile=False, attention="fa3", compile_cache=Path("/tmp/cc"), faults=faults)
    assert s.store_options() == StoreOptions(root=Path("/tmp/st"), mooncake=None, capacity_bytes=1000, group="video",
                                             min_residency_s=9.0, writers=2)
    pooled = Settings(store="mooncake://10.0.0.5:50051", mooncake_local_host="10.0.0.7", mooncake_segment_bytes="2GiB",
                      mooncake_namespace="embedding@model:m@protocol:v3")
    assert pooled.store_is_mooncake and pooled.store == "mooncake://10.0.0.5:50051"
    assert pooled.store_options().mooncake == MooncakeOptions(
        master="10.0.0.5:50051", local_host="10.0.0.7", segment_bytes=2 * 1024**3, buffer_bytes=MOONCAKE_BUFFER_BYTES,
        protocol="tcp", namespace="embedding@model:m@protocol:v3")
    with pytest.raises(ValidationError, match="mooncake://MASTER_HOST:RPC_PORT"):
        Settings(store="mooncake://no-port")
    with pytest.raises(AttributeError):
        s.store_options().writers = 3  # frozen: derived once, never changed on the way down


def test_fp8_and_attention_settings_parse_and_refuse_what_cannot_be():
    s = _from_cli("--dtype", "fp8", "--fp8-bf16-blocks", "3,0,3", "--fp8-gemms", "qkv,fc2")
    assert s.resolved_dtype() == "fp8" and s.fp8_bf16_blocks == [0, 3]  # sorted, once each
    assert s.fp8_gemms == ["qkv", "fc2"]
    with pytest.raises(ValidationError, match="fp8_gemms"):
        Settings(fp8_gemms="qkv,proj")
    with pytest.raises(ValidationError, match="--dtype fp8 with no --fp8-gemms: name at least one of qkv, fc1, fc2"):
        Settings(dtype="fp8", fp8_gemms="")
    assert Settings(fp8_gemms="").fp8_gemms == []  # without fp8 it is not used
    assert Settings().fp8_bf16_blocks == [0] and Settings().attention == "auto"
    with pytest.raises(ValidationError, match="0-based and not negative"):
        Settings(fp8_bf16_blocks="-1")
    with pytest.raises(ValidationError, match="attention"):
        Settings(attention="flash")


def test_unknown_qve_variables_get_the_closest_setting_and_known_ones_nothing():
    from service.config import unknown_env

    environ = {"qve_modle": "x", "QVE_PORT": "1", "QVE_LOG_LEVEL": "debug", "QVE_FAULT_INJECT": "", "QVE_ZZZ": "1",
               "PATH": "/bin", "QVEX": "1"}
    assert unknown_env(environ) == [
        "QVE_ZZZ is not a setting and is ignored; `--help` lists the QVE_ variables",
        "qve_modle is not a setting and is ignored; did you mean QVE_MODEL?",  # matched case-insensitively
    ]


def test_devices_one_engine_each_validated_and_supervised(capsys):
    s = _from_cli("--devices", "cuda:0, cuda:1")
    assert s.engine_devices == ["cuda:0", "cuda:1"] and s.supervised  # several devices need a supervisor
    assert s.api_processes is None and s.api_process_count() == default_api_processes()  # the machine's default
    assert _from_cli("--devices", "cuda:0,cuda:1", "--api-processes", "0").api_process_count() == default_api_processes()
    assert _from_cli("--devices", "cpu,cpu").engine_devices == ["cpu", "cpu"]  # cpu may repeat (tests)
    one = _from_cli("--devices", "cuda:1")
    assert one.device == "cuda:1" and one.engine_devices == ["cuda:1"]  # one = --device
    none = _from_cli("--device", "cpu")
    assert none.devices == [] and none.engine_devices == ["cpu"] and not none.supervised  # today's service
    for bad, says in [("cuda:0,cuda:0", "cuda:0 is listed more than once"),
                      ("cuda,cuda:0", "cuda:0 is listed more than once (cuda is cuda:0)"),
                      ("cuda:0,tpu", "each device must be cpu, cuda or cuda:N, got 'tpu'"),
                      ("auto,auto", "got 'auto'"), ("cpu,cuda:0", "mixes cpu and cuda devices")]:
        assert main(["serve", "--devices", bad]) == 2
        err = capsys.readouterr().err
        assert f"--devices={bad}: " in err and says in err, err


def test_api_processes_default_fits_the_machine(monkeypatch):
    """Unset: several on a GPU (a quarter of the usable cores, 1-8), none on the CPU; 0 and N as given."""
    import service.config as config

    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert config.default_api_processes() == 4
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert config.default_api_processes() == 1
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(128)))
    assert config.default_api_processes() == 8
    assert _from_cli("--device", "cuda").api_process_count() == 8 and _from_cli("--device", "cuda:1").supervised
    assert _from_cli("--device", "cpu").api_process_count() == 0 and not _from_cli("--device", "cpu").supervised
    assert _from_cli("--device", "cuda", "--api-processes", "0").api_process_count() == 0
    assert _from_cli("--device", "cpu", "--api-processes", "3").api_process_count() == 3
    gpu_present = {"/dev/nvidiactl": True}
    real_exists = config.os.path.exists
    monkeypatch.setattr(config.os.path, "exists", lambda p: gpu_present.get(p, False) if p == "/dev/nvidiactl"
                        else real_exists(p))
    assert _from_cli("--device", "auto").api_process_count() == 8
    gpu_present["/dev/nvidiactl"] = False
    assert _from_cli("--device", "auto").api_process_count() == 0


# ---- sizes: `4GiB`, `1.5GB` or bytes ------------------------------------------------------------------
SIZE_SETTINGS = ["store_capacity_bytes", "mooncake_segment_bytes", "max_request_bytes", "max_image_bytes", "video_max_bytes",
                 "video_max_request_bytes", "video_max_process_bytes", "arena_bytes"]


def test_every_byte_count_setting_is_a_size():
    from service.config import is_size

    assert [name for name in Settings.model_fields if is_size(name)] == SIZE_SETTINGS
    # A byte count added later as a plain int would take no `4GiB`: name it *_bytes and annotate it Bytes.
    assert [name for name in Settings.model_fields if name.endswith("_bytes")] == SIZE_SETTINGS


def test_a_size_flag_or_variable_takes_binary_and_decimal_units(monkeypatch):
    s = _from_cli("--store-capacity-bytes", "4GiB", "--max-request-bytes", "1.5GB", "--max-image-bytes", " 3 mib ")
    assert s.store_capacity_bytes == 4 * 1024**3 and type(s.store_capacity_bytes) is int
    assert s.max_request_bytes == 1_500_000_000  # exactly: parsed in integers, not floats
    assert s.max_image_bytes == 3 * 1024**2  # units are case-insensitive, spaces allowed
    monkeypatch.setenv("QVE_ARENA_BYTES", "512MiB")
    monkeypatch.setenv("QVE_STORE_CAPACITY_BYTES", "1.5GB")
    s = Settings()
    assert (s.arena_bytes, s.store_capacity_bytes) == (512 * 1024**2, 1_500_000_000)
    assert _from_cli("--store-capacity-bytes", "2TB").store_capacity_bytes == 2 * 10**12  # the flag wins
    # Plain bytes keep working, as text (flags, variables) and as ints (code, tests).
    assert _from_cli("--arena-bytes", "4096").arena_bytes == 4096
    assert Settings(max_image_bytes=1000, arena_bytes=2**20).store_options().capacity_bytes == 1_500_000_000
    assert Settings(max_image_bytes=1000).image_limits.max_image_bytes == 1000
    assert _from_cli("--max-image-bytes", ".5KiB").max_image_bytes == 512
    assert _from_cli("--max-image-bytes", "1.1KB").max_image_bytes == 1100


@pytest.mark.parametrize("flag, value", [("--store-capacity-bytes", "4XB"), ("--arena-bytes", "4G"),
                                         ("--max-image-bytes", "GiB"), ("--max-request-bytes", "1.5"),
                                         ("--max-request-bytes", "4GiB of RAM")])
def test_a_bad_size_is_refused_in_one_line_naming_the_units(capsys, flag, value):
    assert main(["serve", flag, value]) == 2
    err = capsys.readouterr().err
    assert err == (f"invalid settings: {flag}={value}: not a size; give bytes, or a number and a unit: KiB, MiB, "
                   "GiB, TiB (powers of 1024) or KB, MB, GB, TB (of 1000), e.g. 4GiB or 1.5GB\n")


def test_a_bad_size_variable_and_a_zero_size_are_named(monkeypatch, capsys):
    monkeypatch.setenv("QVE_ARENA_BYTES", "lots")
    assert main(["serve", "--store-capacity-bytes", "0GiB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "QVE_ARENA_BYTES=lots: not a size; give bytes" in err
    assert "--store-capacity-bytes=0GiB: Input should be greater than 0" in err  # the field's own bound


def test_sizes_are_shown_in_the_largest_exact_unit_and_read_back_alike():
    from service.sizes import format_size, parse_size

    assert [format_size(n) for n in (4 * 1024**3, 64 * 1024**2, 1536, 3 * 1024**4, 1_500_000_000, 0)] == \
        ["4GiB", "64MiB", "1536", "3TiB", "1500000000", "0"]
    for name in SIZE_SETTINGS:
        default = Settings.model_fields[name].default
        assert parse_size(format_size(default)) == default, name


def test_videos_decode_on_fewer_workers_than_there_are_and_their_budgets_reach_the_limits():
    assert [Settings(decode_workers=n).video_decode_slots() for n in (1, 2, 3, 8)] == [1, 1, 1, 4]
    assert Settings(decode_workers=8, video_decode_workers=2).video_decode_slots() == 2
    assert Settings(decode_workers=8, video_decode_workers=8).video_decode_slots() == 7  # images keep one
    limits = Settings(video_max_request_bytes="3MiB", video_max_process_bytes="5MiB").video_limits
    assert (limits.max_request_bytes, limits.max_process_bytes) == (3 << 20, 5 << 20)
    # The defaults hold three (a request's) and seven (a process's) of the largest clip Qwen3-VL's released video
    # config makes: 25,165,824 pixels in all, 3 bytes each.
    largest = 3 * 25165824
    limits = Settings().video_limits
    assert limits.max_request_bytes >= 3 * largest and limits.max_process_bytes >= 7 * largest
