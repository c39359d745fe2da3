"""Model selection, flag checks and the CP-flag mapping (integrations/sglang/server_args.py).

The pure tests run on stand-in server args carrying SGLang 0.5.23's defaults (checked against
SGLang's own parser below). The `sglang`-marked tests run SGLang's CLI parsing and its whole
server-arg resolution in this process, with the plugin loaded: `--tp > 1` cannot start on CPU,
but its resolution can, and that is where the mapping happens.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsv4cp.integrations.sglang import ARCHITECTURE, MODEL_TYPE
from dsv4cp.integrations.sglang.server_args import (
    SWA_FULL_TOKENS_RATIO,
    CPSettings,
    Dsv4cpServerArgsError,
    ModelOverrides,
    check_server_args,
    cp_settings_from_server_args,
    resolution_declarations,
    served_by_dsv4cp,
)

UPSTREAM = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41-tiny-reference" / "checkpoint"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None

# SGLang 0.5.23's defaults of the fields the checks read (test_defaults_are_sglangs).
DEFAULTS = dict(
    model_impl="auto",
    model_config_parser="auto",
    tp_size=1,
    pp_size=1,
    dp_size=1,
    attn_dp_size=1,
    enable_dp_attention=False,
    dcp_size=1,
    attn_cp_size=1,
    enable_prefill_cp=False,
    cp_strategy=None,
    ep_size=1,
    moe_a2a_backend="none",
    moe_runner_backend="auto",
    enable_two_batch_overlap=False,
    speculative_algorithm=None,
    quantization=None,
    kv_cache_dtype="auto",
    attention_backend=None,
    prefill_attention_backend=None,
    decode_attention_backend=None,
    dsv4_attn_backend="auto",
    enable_lora=None,
    lora_paths=None,
    enable_multimodal=None,
    is_embedding=False,
    disaggregation_mode="null",
    enable_hisparse=False,
    json_model_override_args="{}",
    device="cpu",
    max_total_tokens=None,
)
CP4 = dict(tp_size=4, enable_prefill_cp=True, cp_strategy="interleave")


def _args(**fields: object) -> SimpleNamespace:
    return SimpleNamespace(**{**DEFAULTS, **fields})


# ---------------------------------------------------------------------------------- selection
@pytest.mark.parametrize(
    ("model_type", "fields", "served"),
    [
        ("deepseek_v41", {}, False),  # SGLang's own V4.1 model, untouched
        ("deepseek_v41", {"model_impl": "dsv4cp"}, True),
        ("deepseek_v41", {"model_config_parser": "dsv4cp"}, True),
        ("deepseek_v41", {"model_impl": "sglang"}, False),
        (MODEL_TYPE, {}, True),  # a dsv4cp export has no other implementation
        (MODEL_TYPE, {"model_impl": "dsv4cp"}, True),
        ("llama", {}, False),
    ],
)
def test_which_checkpoints_dsv4cp_serves(model_type: str, fields: dict, served: bool) -> None:
    assert served_by_dsv4cp(model_type, _args(**fields)) is served


@pytest.mark.parametrize(
    ("model_type", "fields", "match"),
    [
        (MODEL_TYPE, {"model_impl": "transformers"}, "only dsv4cp's implementation"),
        ("llama", {"model_impl": "dsv4cp"}, "model_type 'llama'"),
        (
            "deepseek_v41",
            {"model_impl": "dsv4cp", "model_config_parser": "hf"},
            "--model-config-parser hf",
        ),
        (  # the parser picks dsv4cp, the explicit impl another: neither wins silently
            "deepseek_v41",
            {"model_impl": "sglang", "model_config_parser": "dsv4cp"},
            "drop --model-impl sglang",
        ),
    ],
)
def test_impossible_selections_are_refused(model_type: str, fields: dict, match: str) -> None:
    with pytest.raises(Dsv4cpServerArgsError, match=match):
        served_by_dsv4cp(model_type, _args(**fields))


# ---------------------------------------------------------------------------------- CP mapping
@pytest.mark.parametrize(
    ("fields", "size"),
    [
        ({}, 1),
        ({"tp_size": 1, "enable_prefill_cp": True, "cp_strategy": "interleave"}, 1),
        (CP4, 4),
        ({**CP4, "attn_cp_size": 4}, 4),
        ({"tp_size": 8, "enable_prefill_cp": True, "cp_strategy": "interleave"}, 8),
    ],
)
def test_cp_flags_map_to_dsv4cp_cp(fields: dict, size: int) -> None:
    settings = check_server_args(_args(**fields))
    assert settings == cp_settings_from_server_args(_args(**fields))
    assert settings.size == size and settings.enabled is (size > 1)
    assert settings.strategy == ("interleave" if size > 1 else None)
    decl = resolution_declarations(_args(**fields))
    assert decl["attention_backend"] == "torch_native"
    if size > 1:
        assert decl["attn_cp_size"] == size and decl["enable_cp_tp_group_sharing"] is True
    else:
        assert "attn_cp_size" not in decl and "enable_cp_tp_group_sharing" not in decl


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({**CP4, "cp_strategy": "zigzag"}, "--cp-strategy zigzag is not supported"),
        ({"tp_size": 4, "enable_prefill_cp": True}, "needs --cp-strategy interleave"),
        ({"cp_strategy": "interleave"}, "no effect without --enable-prefill-cp"),
        ({**CP4, "attn_cp_size": 2}, "--attn-cp-size 2 must equal --tp 4"),
        ({"tp_size": 4, "attn_cp_size": 4}, "--attn-cp-size needs --enable-prefill-cp"),
        ({"tp_size": 2}, "--tp 2 needs --enable-prefill-cp"),
        ({"pp_size": 2}, "--pp-size"),
        ({**CP4, "dp_size": 2}, "data parallelism"),
        ({"enable_dp_attention": True}, "data parallelism"),
        ({"dcp_size": 2}, "--dcp-size"),
        ({"ep_size": 2}, "--ep-size"),
        ({"moe_runner_backend": "triton"}, "--moe-runner-backend"),
        ({"moe_a2a_backend": "deepep"}, "--moe-a2a-backend"),
        ({"enable_two_batch_overlap": True}, "two-batch-overlap"),
        ({"speculative_algorithm": "EAGLE"}, "speculative"),
        ({"quantization": "fp8"}, "--quantization"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype"),
        ({"attention_backend": "dsv4"}, "--attention-backend dsv4"),
        ({"prefill_attention_backend": "fa3"}, "--prefill-attention-backend fa3"),
        ({"dsv4_attn_backend": "flashmla"}, "--dsv4-attn-backend"),
        ({"enable_lora": True}, "LoRA"),
        ({"lora_paths": ["a=b"]}, "LoRA"),
        ({"enable_multimodal": True}, "text-only"),
        ({"is_embedding": True}, "--is-embedding"),
        ({"disaggregation_mode": "prefill"}, "disaggregation"),
        ({"enable_hisparse": True}, "hisparse"),
        ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache not supported"),
        ({"enable_lmcache": True, "enable_flexkv": True}, "--enable-lmcache, --enable-flexkv"),
        ({"enable_unified_memory": True}, "--enable-unified-memory"),
        ({"json_model_override_args": '{"num_hidden_layers": 2}'}, "--json-model-override-args"),
        ({"json_model_override_args": "{bad"}, "--json-model-override-args"),
        ({"device": "cuda", "max_total_tokens": None}, "--max-total-tokens on CUDA"),
        ({"device": "npu"}, "--device npu"),
        ({"json_model_override_args": '{"dsv4cp_graphs": [64]}'}, "dsv4cp_graphs .* --device cuda"),
    ],
)
def test_unsupported_flags_are_refused_in_one_line(fields: dict, match: str) -> None:
    with pytest.raises(Dsv4cpServerArgsError, match=match) as e:
        check_server_args(_args(**fields))
    assert "\n" not in str(e.value) and str(e.value).startswith("dsv4cp: ")


def test_flags_that_apply_are_accepted() -> None:
    ok = _args(
        device="cuda",
        max_total_tokens=262144,
        page_size=64,
        attention_backend="torch_native",
        chunked_prefill_size=16384,
        context_length=65536,
        **CP4,
    )
    assert check_server_args(ok) == CPSettings(4, "interleave")


def test_a_bad_dsv4cp_variable_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Read lazily, DSV4CP_CHECK_WINDOW=yes-please failed the first forward in the scheduler;
    now the server does not start (one line naming it), and a typo is a warning, logged once."""
    monkeypatch.setenv("DSV4CP_CHECK_WINDOW", "yes-please")
    with pytest.raises(Dsv4cpServerArgsError, match="^dsv4cp: DSV4CP_CHECK_WINDOW must be 1 or 0"):
        check_server_args(_args())
    monkeypatch.delenv("DSV4CP_CHECK_WINDOW")
    monkeypatch.setenv("DSV4CP_KERNELS_OFF", "sparse_attn")
    with pytest.raises(Dsv4cpServerArgsError, match=r"unknown routes \['sparse_attn'\]"):
        check_server_args(_args())
    monkeypatch.delenv("DSV4CP_KERNELS_OFF")
    monkeypatch.setenv("DSV4CP_FLASHMLA_WORKSPACE", "2048")
    with caplog.at_level("WARNING", logger="dsv4cp.integrations.sglang.server_args"):
        check_server_args(_args())
        check_server_args(_args())
    said = [
        r.getMessage() for r in caplog.records if "DSV4CP_FLASHMLA_WORKSPACE " in r.getMessage()
    ]
    assert said == [
        "dsv4cp: DSV4CP_FLASHMLA_WORKSPACE is not a dsv4cp variable and changes nothing "
        "(did you mean DSV4CP_FLASHMLA_WORKSPACE_MIB?)"
    ]


def test_graphs_are_bounded_by_the_served_context() -> None:
    """The graphs' max_context is the server's context (SGLang sets `context_len` on the HF
    config from --context-length), not the checkpoint's max_position_embeddings (1M at Flash)."""
    from dsv4cp.integrations.sglang.model import served_context

    hf = SimpleNamespace(context_len=65536, max_position_embeddings=1048576)
    assert served_context(hf) == 65536
    assert served_context(SimpleNamespace(max_position_embeddings=4096)) == 4096
    assert served_context(SimpleNamespace()) is None


def test_model_override_keys_pick_numerics_and_graphs() -> None:
    """`--json-model-override-args` carries dsv4cp's own options, nothing else."""
    ok = '{"dsv4cp_quant": "none", "dsv4cp_graphs": [64, 256], "dsv4cp_graph_max_requests": 4}'
    check_server_args(_args(json_model_override_args=ok, device="cuda", max_total_tokens=4096))
    assert ModelOverrides.parse(ok) == ModelOverrides("none", (64, 256), 4)
    assert ModelOverrides.parse("{}") == ModelOverrides()
    hf = SimpleNamespace(dsv4cp_quant="qat")  # what SGLang sets on the model's HF config
    assert ModelOverrides.of_hf_config(hf) == ModelOverrides("qat")
    for bad, match in [
        ('{"dsv4cp_quant": "fp8"}', "dsv4cp_quant must be"),
        ('{"dsv4cp_graphs": [0]}', "dsv4cp_graphs must be"),
        ('{"dsv4cp_graphs": 64}', "dsv4cp_graphs must be"),
        ('{"dsv4cp_graphs": 0}', "dsv4cp_graphs must be"),
        ('{"dsv4cp_graphs": false}', "dsv4cp_graphs must be"),
        ('{"dsv4cp_graphs": {}}', "dsv4cp_graphs must be"),
        ('{"dsv4cp_graph_max_requests": 4}', "no effect without dsv4cp_graphs"),
        ('{"dsv4cp_graph_max_requests": true}', "dsv4cp_graph_max_requests"),
        ('{"num_hidden_layers": 2}', "not supported"),
        ("[1]", "must be an object"),
    ]:
        with pytest.raises(Dsv4cpServerArgsError, match=match):
            check_server_args(_args(json_model_override_args=bad))


# ---------------------------------------------------------------------------------- in SGLang
@pytest.fixture(scope="module")
def sglang_with_plugin():
    """SGLang with dsv4cp's plugin loaded in this process (as `launch_server` does)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from dsv4cp.integrations.sglang import plugin

    assert plugin._registered, "the dsv4cp sglang.srt.plugins entry point is not installed"
    from sglang.srt import server_args

    return server_args


@pytest.mark.parametrize("name", sorted(DEFAULTS))
@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_defaults_are_sglangs(name: str) -> None:
    from sglang.srt.server_args import prepare_server_args

    parsed = prepare_server_args(["--model-path", "x", "--device", "cpu"])
    assert getattr(parsed, name) == DEFAULTS[name]


def _resolve(sglang_with_plugin, argv: list[str]) -> tuple[object, object]:
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view

    args = sglang_with_plugin.prepare_server_args(argv)
    args.resolve_once()
    return resolving_view(args), model_config_of(args)


@pytest.mark.parametrize(
    ("argv", "size"),
    [
        ([], 1),
        (["--tp", "4", "--enable-prefill-cp", "--cp-strategy", "interleave"], 4),
        (
            [
                "--tp",
                "8",
                "--enable-prefill-cp",
                "--cp-strategy",
                "interleave",
                "--attn-cp-size",
                "8",
            ],
            8,
        ),
    ],
)
@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_cp_flags_through_sglangs_resolution(
    sglang_with_plugin, argv: list[str], size: int
) -> None:
    from sglang.srt.model_loader.utils import get_model_architecture

    from dsv4cp.integrations.sglang.cp import SGLangCP
    from dsv4cp.integrations.sglang.model import DeepseekV41ForCausalLM

    view, mc = _resolve(
        sglang_with_plugin,
        ["--model-path", str(UPSTREAM), "--device", "cpu", "--model-impl", "dsv4cp", *argv],
    )
    # dsv4cp's model, under dsv4cp's config; SGLang's V4 rules did not fire
    assert mc.hf_config.architectures == [ARCHITECTURE] and mc.hf_config.model_type == MODEL_TYPE
    assert mc.hf_config.dsv4cp_source_model_type == "deepseek_v41"
    assert mc.hf_config.dsv4cp_quantization_config["quant_method"] == "fp8"
    assert mc.quantization is None and not mc.is_multimodal
    assert get_model_architecture(mc)[0] is DeepseekV41ForCausalLM
    assert view.attention_backend == "torch_native" and view.kv_cache_dtype == "auto"
    assert view.page_size == 1  # SGLang's default, not V4's forced 256
    assert view.cuda_graph_config.decode.backend == "disabled"
    assert view.cuda_graph_config.prefill.backend == "disabled"
    # the CP mapping: SGLang's attention-CP group is the TP group; SGLang does not shard
    assert view.enable_prefill_cp is (size > 1) and view.attn_cp_size == size
    assert view.enable_cp_tp_group_sharing is (size > 1)
    assert SGLangCP(cp_settings_from_server_args(view)).settings.size == size
    # SGLang's hybrid-SWA pools, the window the model's (16), dsv4cp's default SWA ratio
    assert mc.is_hybrid_swa and mc.sliding_window_size == 16 and mc.head_dim == 1
    assert view.swa_full_tokens_ratio == SWA_FULL_TOKENS_RATIO == 0.1


@pytest.mark.parametrize(
    ("argv", "hybrid", "ratio"),
    [
        (["--swa-full-tokens-ratio", "0.3"], True, 0.3),
        (["--disable-hybrid-swa-memory"], False, SWA_FULL_TOKENS_RATIO),
    ],
)
@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_swa_flags_are_the_users(
    sglang_with_plugin, argv: list[str], hybrid: bool, ratio: float
) -> None:
    view, mc = _resolve(
        sglang_with_plugin,
        ["--model-path", str(UPSTREAM), "--device", "cpu", "--model-impl", "dsv4cp", *argv],
    )
    assert mc.is_hybrid_swa is hybrid and view.swa_full_tokens_ratio == ratio


@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_sglangs_own_kv_buffers_cost_next_to_nothing(sglang_with_plugin) -> None:
    """SGLang's KV pools of a dsv4cp-served model (never read) built with the geometry SGLang
    derives from its config, at the released-fixture server's sizes (4096 slots, fp32): ~13 B
    per token slot (head dim 1); with the model's head dim (64) as before, 3,585 B."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    _, mc = _resolve(
        sglang_with_plugin,
        ["--model-path", str(UPSTREAM), "--device", "cpu", "--model-impl", "dsv4cp"],
    )
    assert mc.full_attention_layer_ids == [0] and mc.swa_attention_layer_ids == [1, 2, 3, 4, 5, 6]
    size = 4096
    pool = SWAKVPool(
        size=size,
        size_swa=int(size * SWA_FULL_TOKENS_RATIO),
        page_size=1,
        dtype=torch.float32,
        head_num=mc.get_num_kv_heads(1),
        head_dim=mc.head_dim,
        swa_attention_layer_ids=mc.swa_attention_layer_ids,
        full_attention_layer_ids=mc.full_attention_layer_ids,
        device="cpu",
    )
    now = sum(pool.get_kv_size_bytes()) / size
    before = MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=torch.float32,
        head_num=1,
        head_dim=64,  # the fixture's head dim, which SGLang used to size these buffers with
        layer_num=7,
        device="cpu",
        enable_memory_saver=False,
    )
    was = sum(before.get_kv_size_bytes()) / size
    print(f"SGLang's own KV buffers: {now:.1f} B/slot, before {was:.1f}")
    assert now < 16 and was > 3584


@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_without_model_impl_sglangs_own_v41_is_untouched(sglang_with_plugin) -> None:
    from sglang.srt.model_loader.utils import get_model_architecture

    view, mc = _resolve(
        sglang_with_plugin,
        [
            "--model-path",
            str(UPSTREAM),
            "--device",
            "cpu",
            "--tp",
            "4",
            "--enable-prefill-cp",
            "--cp-strategy",
            "interleave",
        ],
    )
    assert mc.hf_config.architectures == ["DeepseekV4ForCausalLM"]
    assert mc.hf_config.model_type == "deepseek_v41" and mc.quantization == "fp8"
    cls, _ = get_model_architecture(mc)
    assert cls.__module__ == "sglang.srt.models.deepseek_v4"
    assert (view.attention_backend, view.page_size, view.kv_cache_dtype) == (
        "dsv4",
        256,
        "fp8_e4m3",
    )
    assert view.attn_cp_size == 4 and view.enable_cp_tp_group_sharing is False


@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_page_size_is_the_users(sglang_with_plugin) -> None:
    view, _ = _resolve(
        sglang_with_plugin,
        [
            "--model-path",
            str(UPSTREAM),
            "--device",
            "cpu",
            "--model-impl",
            "dsv4cp",
            "--page-size",
            "64",
        ],
    )
    assert view.page_size == 64


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--tp", "2", "--enable-prefill-cp", "--cp-strategy", "zigzag"], "zigzag"),
        (["--attention-backend", "dsv4"], "--attention-backend dsv4"),
    ],
)
@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_refusals_through_sglangs_resolution(
    sglang_with_plugin, argv: list[str], match: str
) -> None:
    """The Engine path (no CLI): the model-override provider refuses during resolution."""
    hooked = sglang_with_plugin.prepare_server_args
    prepare_server_args = getattr(hooked, "__wrapped__", hooked)  # SGLang's, not the CLI hook
    args = prepare_server_args(
        ["--model-path", str(UPSTREAM), "--device", "cpu", "--model-impl", "dsv4cp", *argv]
    )
    with pytest.raises(Dsv4cpServerArgsError, match=match):
        args.resolve_once()


@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_cli_hook_exits_with_one_line(sglang_with_plugin, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        sglang_with_plugin.prepare_server_args(
            [
                "--model-path",
                str(UPSTREAM),
                "--device",
                "cpu",
                "--model-impl",
                "dsv4cp",
                "--tp",
                "2",
                "--enable-prefill-cp",
                "--cp-strategy",
                "zigzag",
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err[-1] == (
        "sglang serve: error: dsv4cp: --cp-strategy zigzag is not supported "
        "yet; use --cp-strategy interleave"
    )


@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_cli_hook_refuses_a_bad_dsv4cp_variable(
    sglang_with_plugin, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("DSV4CP_FP8_GEMM", "cutlass")
    with pytest.raises(SystemExit) as e:
        sglang_with_plugin.prepare_server_args(
            ["--model-path", str(UPSTREAM), "--device", "cpu", "--model-impl", "dsv4cp"]
        )
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "sglang serve: error: dsv4cp: DSV4CP_FP8_GEMM must be one of auto, triton, cublas, "
        "gluon, got 'cutlass'"
    )


@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="sglang not installed")
def test_cli_refuses_a_config_without_text_config(
    sglang_with_plugin, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Reliability probe 2b-12: an AttributeError from inside SGLang, now one line."""
    import json

    for model_type, impl in ((MODEL_TYPE, ()), ("deepseek_v41", ("--model-impl", "dsv4cp"))):
        cfg = json.loads((UPSTREAM / "config.json").read_text())
        del cfg["text_config"]
        cfg["model_type"] = model_type
        path = tmp_path / model_type
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(SystemExit) as e:
            sglang_with_plugin.prepare_server_args(
                ["--model-path", str(path), "--device", "cpu", *impl]
            )
        assert e.value.code == 2
        assert "config.json has no text_config" in capsys.readouterr().err.splitlines()[-1]
