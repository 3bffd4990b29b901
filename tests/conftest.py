"""Shared test settings: hypothesis without deadlines (CI machines are shared and noisy), seeded torch; the
markers each test gets from where it lives (see pyproject.toml for what each means); and a check that every
``dev`` dependency is installed, so a broken install fails the run instead of skipping hundreds of tests."""

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "attnkit",
    deadline=None,
    max_examples=40,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# make test-fast (--hypothesis-profile attnkit-fast): fewer examples of each property while working; make test
# runs every property at the full count
settings.register_profile("attnkit-fast", parent=settings.get_profile("attnkit"), max_examples=12)
settings.load_profile("attnkit")


# the modules of pyproject.toml's `dev` extra that tests import (pytest-xdist runs `make test`; ruff and mypy
# are commands of `make check`)
DEV_MODULES = (
    "hypothesis",
    "numpy",
    "rich",
    "matplotlib",
    "transformers",
    "triton",
    "setuptools",
    "sphinx",
    "myst_parser",
    "starlette",
    "uvicorn",
    "openai",
    "httpx",
)

ROOT = Path(__file__).resolve().parents[1]

# marker -> the test files (or folders) that carry it; tests elsewhere are marked where they are written
MARKED_PATHS = {
    "distributed": ["tests/distributed/"],
    "hf": ["tests/integrations/"],
    "triton_interpreter": ["tests/backends/test_triton.py", "tests/backends/test_triton_ops.py"],
    # torch.compile traces, the benchmark scripts and child pytest runs: seconds to minutes a test
    "slow": [
        "tests/backends/test_compile.py",
        "tests/backends/test_auto_compile.py",
        "tests/test_benchmarks.py",
        "tests/test_suite_output.py",
        "tests/nn/test_content_sparse_compile.py",
        "tests/backends/test_compile_quality.py",
    ],
}

# the slowest tests of the core (each over 10 s in a --durations run of the fast lane on 2 loaded cores),
# with all their parameters; `make test` runs them, `make test-fast` leaves them out
SLOW = (
    "tests/backends/test_flash.py::test_small_tiles_for_documents_in_both_directions",
    "tests/backends/test_flash_properties.py::test_forward_backward_memory_grows_linearly",
    "tests/backends/test_padding_garbage.py::test_hidden_garbage_changes_nothing",
    "tests/cache/test_protocol.py::test_static_cache_under_torch_compile",
    "tests/diagnostics/test_doctor.py::test_a_healthy_trained_model_gets_no_findings",
    "tests/diagnostics/test_doctor.py::test_a_loss_reading_one_position_is_not_a_vanishing_gradient",
    "tests/diagnostics/test_doctor.py::test_report_text_markdown_and_plots",
    "tests/nn/test_attention.py::test_self_attention_matches_the_written_out_formula",
    "tests/nn/test_learning.py::test_tiny_decoder_learns_to_copy",
    "tests/nn/test_precision.py::test_tiny_decoder_forward_under_torch_compile",
    "tests/test_cli.py::test_console_script_entry_point",
    "tests/test_cli.py::test_demo_quick_runs_every_step",
    "tests/test_cli.py::test_doctor_one_example_in_full",
    "tests/test_cli.py::test_import_attnkit_stays_light",
    "tests/test_cli.py::test_the_wheel_ships_types_and_builds_without_warnings",
    "tests/test_functional.py::test_dropout_is_reproducible",
    "tests/test_functional.py::test_gradients_flow_into_learnable_bias_parameters",
    "tests/test_functional.py::test_hypothesis_cases_against_oracle",
    "tests/test_functional.py::test_on_demand_submodules_load_when_named",
    "tests/test_generate.py::test_compiled_decode_steps_give_the_eager_tokens",
    "tests/test_generate.py::test_compiled_weights_are_frozen_per_model_and_refreshed_after_in_place_changes",
    "tests/test_generate.py::test_ragged_batch_equals_one_by_one",
    "tests/test_masks.py::test_block_structure_prints_at_most_64_characters_a_side",
    "tests/test_masks.py::test_combined_structures_are_sound",
    "tests/test_masks.py::test_from_flex_matches_flex_attention_on_cpu",
    "tests/test_quantize.py::test_bfloat16_model_generates_the_same_tokens",
    "tests/test_quantize.py::test_quantized_cache_keeps_greedy_tokens",
    "tests/test_sinks.py::test_gradcheck_float64",
    "tests/test_sinks.py::test_property_any_shape_and_sink",
    "tests/test_sinks.py::test_sdpa_sinks_gradcheck_float64",
    "tests/test_varlen.py::test_batched_call_matches_per_sequence_attention",
    "tests/test_varlen.py::test_sinks_match_per_sequence_attention_and_the_oracle",
    "tests/test_varlen.py::test_varlen_matches_per_sequence_attention",
    "tests/test_docs.py::test_code_blocks_run",
    # over 10 s each in a --durations run of the whole suite on 2 loaded cores (2026-12-03)
    "tests/test_functional.py::test_dtypes_head_dims_and_groups",
    "tests/test_functional.py::test_every_mask_against_oracle",
    "tests/test_cli_distill.py::test_half_width_student_learns_the_teachers_recall",
    "tests/serve/test_cli_serve.py::test_serve_starts_answers_and_stops_on_a_signal",
    "tests/test_engine_sink.py::test_engine_equals_sink_cache_alone",
    "tests/test_sinks.py::test_generate_with_sinks_decodes_like_the_full_forward",
    "tests/test_varlen.py::test_sinks_on_long_sequences_with_zero_lengths",
    "tests/test_packed_quality.py::test_head_dependent_masks_on_every_path",
    "tests/test_packed_quality.py::test_varlen_views_strided_in_any_dimension",
    "tests/backends/test_triton_packed_quality.py::test_kernel_case",
    "tests/test_decoding_quality.py::test_chunked_prefill_with_sinks_and_latent_attention_matches_generate",
    "tests/nn/test_save.py::test_save_and_load_give_the_same_logits",
    "tests/test_quantize.py::test_int4_weights_and_int8_activations_keep_greedy_tokens",
    "tests/test_quantize.py::test_weight_quantization_keeps_greedy_tokens",
    "tests/test_engine.py::test_chunked_prefill_gives_the_tokens_of_each_request_alone",
    "tests/nn/test_rope_per_sequence.py::test_greedy_tokens_alone_batched_engine_and_speculative",
    "src/attnkit/decoding/engine.py::attnkit.decoding.engine.Engine",
    # and the slowest of what was left (over 4 s each in a --durations run of the fast lane)
    "tests/test_varlen.py::test_long_sequences_with_zero_lengths",
    "tests/test_sinks.py::test_rule_against_the_oracle_forward_and_backward",
    "tests/serve/test_app.py::test_bad_completion_requests_name_the_field",
    "tests/backends/test_splitkv.py::test_the_paged_decode_path_takes_a_long_sequence_split_over_its_blocks",
    "tests/test_quantize.py::test_free_running_generation_agrees",
    # over 2 s each (all parameters together) in a whole-suite run on a cold clean clone (2026-12-03)
    "tests/test_packed_quality.py::test_extreme_sinks_in_every_dtype",
    "tests/decoding/test_speculative.py::test_verify_rule_keeps_the_target_distribution",
    "tests/decoding/test_speculative.py::test_sampled_speculative_keeps_the_target_distribution",
    "tests/test_threads.py::test_a_new_process_generates_at_the_stored_count_without_probing",
    "tests/nn/test_products.py::test_a_new_process_reads_the_stored_choice_and_times_nothing",
    "tests/test_engine_sink.py::test_preemption_and_prefix_caching_give_the_same_tokens",
    "tests/test_content_sparse_masks.py::test_under_torch_compile_with_the_mask_built_inside",
    "tests/nn/test_dsa.py::test_selected_attention_passes_gradcheck",
    "tests/nn/test_dsa.py::test_a_dsa_decoder_trains_and_generates_as_recomputing_every_position",
    "tests/nn/test_models.py::test_layer_masks_decode_with_caches_like_full_recomputation",
    "tests/nn/test_latent.py::test_an_mla_decoder_generates_through_static_paged_caches_and_the_engine_as_a_full_forward",
)


def pytest_configure(config):
    """Keep pytest's final "N passed in X s" line, which CI reads.  addopts already holds ``-q``, so one more
    ``-q`` on the command line makes ``-qq``, and below ``-q`` pytest prints no summary line at all.

    Fail at once when a ``dev`` dependency is missing: each is a requirement of the suite, not an option.

    Keep the suite's measured choices out of the user's cache folder (``ATTNKIT_CACHE_DIR=""``)."""
    if config.option.verbose < -1:
        config.option.verbose = -1
    # decode-product choices are stored per machine under the user's cache folder: the suite (its doctests and
    # the child processes it starts included) stores and reads none; the tests of storing name their own folder
    os.environ["ATTNKIT_CACHE_DIR"] = ""
    missing = [m for m in DEV_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(
            f"the test suite needs {', '.join(missing)} (attnkit's dev dependencies): "
            f"install them with pip install -e '.[dev]' (make test does)"
        )


def pytest_collection_modifyitems(config, items):
    for item in items:
        where = Path(item.path).resolve().relative_to(ROOT).as_posix()
        for marker, paths in MARKED_PATHS.items():
            if any(where == p or (p.endswith("/") and where.startswith(p)) for p in paths):
                item.add_marker(marker)
        if "interpreted" in getattr(item, "fixturenames", ()):
            item.add_marker("triton_interpreter")
        if item.nodeid.split("[")[0] in SLOW:
            item.add_marker("slow")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of tiny tensors and models: a second thread only adds OpenMP
    synchronisation, which costs milliseconds on a loaded machine.  Test modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fresh_dynamo(one_thread):
    """Every test traces from scratch (no compiled code or recompile counts carried over), on one thread.
    Compile tests opt in with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def t5_bucket():
    """T5's relative-position bucket of one integer ``rel = j - p``, written out as in the T5 paper's code: the
    reference for ``attnkit.bias.t5_bucket`` and ``attnkit.nn.T5RelativeBias``."""

    def bucket(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
        ret = 0
        n = -rel
        if bidirectional:
            num_buckets //= 2
            if n < 0:
                ret += num_buckets
            n = abs(n)
        else:
            n = max(n, 0)
        max_exact = num_buckets // 2
        if n < max_exact:
            return ret + n
        log_ratio = math.log(n / max_exact) / math.log(max_distance / max_exact)
        return ret + min(max_exact + int(log_ratio * (num_buckets - max_exact)), num_buckets - 1)

    return bucket


@pytest.fixture
def attnkit_llama():
    """A two-layer Hugging Face Llama (weights drawn after ``torch.manual_seed(0)``, eval mode) running attnkit's
    attention (``attn_implementation="attnkit"``); needs transformers."""
    from _models import tiny_llama

    from attnkit.integrations import hf

    model = tiny_llama(attn_implementation=None)
    hf.register()
    model.set_attn_implementation("attnkit")
    return model
