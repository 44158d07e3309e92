"""Every family end to end: Redis, a real worker, parity with sequential generate.

The families are the modules of vlmq.worker.model.families, discovered; the tests below
check that discovery misses none, then run each one. Per family, one worker serves a
caption job (4 images in 2 sizes) and an OCR job (2 PDF pages) at max batch 4. Each
item's text must equal sequential `mlx_vlm.stream_generate` on the same pixels with
the same templated prompt, at temperature 0, cut at the same stop strings. Then
either a restarted worker serves the same images from the disk cache with 0 tower
calls, or (families whose cached features would change the text) the worker said at
start that it runs uncached.
"""

from __future__ import annotations

import pkgutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.helpers import finish, make_images, make_pdf
from vlmq.producer.client import Client
from vlmq.shared.keys import Keys
from vlmq.worker.engine.check import check_model
from vlmq.worker.model import families, mlx_adapter
from vlmq.worker.model.defaults import resolve
from vlmq.worker.model.tiny import build_tiny_model
from vlmq.worker.prep import decode

MAX_SIDE = 112
MAX_TOKENS = 10
SIZES = [(96, 96), (128, 80)]


def _stats(redis: Redis, name: str) -> dict[str, str]:
    raw = redis.hgetall(Keys().worker_stats(name))
    return {k.decode(): v.decode() for k, v in raw.items()}


def _reference(model_dir: Path, images: list[Path], pdf: Path) -> list[str]:
    """Sequential mlx_vlm generate, one item at a time, as a user would run it."""
    from mlx_vlm import load, stream_generate

    model, processor = load(str(model_dir))
    model_type = str(model.config.model_type)
    eos = mlx_adapter.eos_token_ids(processor)
    pdf_data = pdf.read_bytes()
    items = [(decode.decode_image(p.read_bytes(), MAX_SIDE), "caption") for p in images]
    items += [(decode.render_pdf_page(pdf_data, page, MAX_SIDE), "ocr") for page in (1, 2)]
    texts = []
    for image, task in items:
        res = resolve(model_type, task, None, MAX_TOKENS, 0.0, None, model_id=str(model_dir))
        prompt = mlx_adapter.format_prompt(processor, model.config, res.prompt, num_images=1)
        *_, last = stream_generate(model, processor, prompt, image=[image],
                                   max_tokens=MAX_TOKENS, temperature=0.0)
        tokens = list(last.token_ids)
        if tokens and tokens[-1] in eos:
            tokens = tokens[:-1]
        text = mlx_adapter.decode(processor, tokens)
        cuts = [i for i in (text.find(s) for s in res.stop) if i >= 0]
        texts.append(text[:min(cuts)] if cuts else text)
    return texts


def test_every_module_of_the_package_is_a_registered_family() -> None:
    modules = sorted(m.name for m in pkgutil.iter_modules(families.__path__)
                     if not m.name.startswith("_"))
    assert list(families.names()) == modules  # named after their model types, so unique
    for name in modules:
        family = families.get(name)
        assert sys.modules[f"vlmq.worker.model.families.{name}"].FAMILY is family
        assert family.tiny.config["model_type"] == family.model_type
    assert families.get("QWEN2_VL") is families.FAMILIES["qwen2_vl"]
    with pytest.raises(ValueError, match="not one of vlmq's families"):
        families.get("llava")


@pytest.fixture
def family_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An importable package of family modules in tmp_path (its name: the folder's)."""
    folder = tmp_path / f"vlmq_families_{tmp_path.name}"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "_shared.py").write_text("NOT_A_FAMILY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield folder
    for name in [m for m in sys.modules if m.startswith(folder.name)]:
        del sys.modules[name]


def test_a_new_family_is_one_file(family_package: Path) -> None:
    (family_package / "newfam.py").write_text(
        "from dataclasses import replace\n"
        "from vlmq.worker.model.families.qwen2_vl import FAMILY as QWEN\n"
        "FAMILY = replace(QWEN, model_type='newfam')\n")
    found = families.discover(family_package.name)
    assert list(found) == ["newfam"] and found["newfam"].spec.cacheable


@pytest.mark.parametrize(("source", "error"), [
    ("FAMILY = None\n", "defines no FAMILY"),
    ("from vlmq.worker.model.families.gemma3 import FAMILY\n", "a family module is named after"),
])
def test_discovery_refuses_a_half_made_family(family_package: Path, source: str,
                                              error: str) -> None:
    (family_package / "broken.py").write_text(source)
    with pytest.raises((TypeError, ValueError), match=error):
        families.discover(family_package.name)


@pytest.mark.slow
@pytest.mark.parametrize("arch", families.names())
def test_family_batched_parity_and_vision_cache(
        arch: str, redis_url: str, redis: Redis, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory, procs: list) -> None:
    model = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)
    images = make_images(tmp_path / "imgs", 4, sizes=SIZES)
    pdf = make_pdf(tmp_path / "doc.pdf", 2)
    expected = _reference(model, images, pdf)
    assert len(set(expected[:4])) == 4, "different images must give different outputs"

    client = Client(redis_url)
    kw = {"max_side": MAX_SIDE, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    cap = client.caption(images, **kw)
    ocr = client.ocr([pdf], **kw)
    proc = helpers.start_worker(redis_url, model, tmp_path, "--burst", "--max-batch", "4",
                                name="cold")
    procs.append(proc)
    rc, out = finish(proc, timeout=240)
    assert rc == 0, out
    got = [r.text for job in (cap, ocr) for r in job.results()]
    assert got == expected, out
    assert [r.page for r in ocr.results()] == [1, 2]

    # `vlmq model check` agrees: parity holds, and it reports what the table says.
    report = check_model(str(model), max_tokens=8)
    assert report.parity, report.lines()
    assert report.model_type == arch and set(report.tok_s) == {0, 1, 4}

    spec = mlx_adapter.family_of(arch)
    if spec.prefill_one:
        assert "prefills one prompt at a time" in out
    cold = _stats(redis, "cold")
    assert int(cold["tower_calls"]) == 6
    if not spec.cacheable:
        assert f"vision features of model type {arch} cannot be cached" in out
        return
    # The result cache would answer before the vision cache is even asked: off here.
    again = client.caption(images, **kw, result_cache="off")
    proc = helpers.start_worker(redis_url, model, tmp_path, "--burst", name="warm")
    procs.append(proc)
    rc, out = finish(proc, timeout=240)
    assert rc == 0, out
    assert int(_stats(redis, "warm")["tower_calls"]) == 0
    results = list(again.results())
    assert all(r.vision_cache_hit for r in results)
    assert [r.text for r in results] == expected[:4]


@pytest.mark.slow
def test_deepseekocr_is_refused_at_start_with_the_reason(
        redis_url: str, tmp_path: Path, procs: list) -> None:
    folder = tmp_path / "deepseek-ocr"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "deepseekocr"}')
    with pytest.raises(mlx_adapter.ModelLoadError, match="SAMViTConfig"):
        mlx_adapter.load_model(str(folder))
    from click.testing import CliRunner

    from vlmq.cli.worker import model_group

    checked = CliRunner().invoke(model_group, ["check", str(folder)])
    # An unsupported model type is a configuration error: 78 (EX_CONFIG), never restarted.
    assert checked.exit_code == 78 and "deepseekocr is not supported" in checked.output
    proc = helpers.start_worker(redis_url, folder, tmp_path, "--burst")
    procs.append(proc)
    rc, out = finish(proc)
    assert rc != 0
    assert "model type deepseekocr is not supported" in out and "1024 px" in out


def test_an_unverified_family_is_refused_before_its_weights_load(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llava"}')
    with pytest.raises(mlx_adapter.ModelLoadError,
                       match=r"llava is not one vlmq has verified.*qwen2_vl"):
        mlx_adapter.load_model(str(tmp_path))


def test_make_tiny_offers_every_family(tmp_path: Path) -> None:
    import click
    from click.testing import CliRunner

    from vlmq.cli.worker import make_tiny_cmd, model_group

    (arch,) = [p for p in make_tiny_cmd.params if p.name == "arch"]
    assert isinstance(arch.type, click.Choice) and tuple(arch.type.choices) == families.names()
    out = CliRunner().invoke(model_group, ["make-tiny", str(tmp_path / "m"), "--arch", "glm_ocr"])
    assert out.exit_code == 0, out.output
    assert '"model_type": "glm_ocr"' in (tmp_path / "m" / "config.json").read_text()


@pytest.mark.slow
def test_model_check_exits_non_zero_on_a_parity_failure(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen3_vl batched without its prefill limit really differs (deepstack padding)."""
    from click.testing import CliRunner

    from vlmq.cli.worker import model_group
    from vlmq.worker.engine.batcher import IGNORE_LIMITS_ENV

    model = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_vl"), arch="qwen3_vl")
    monkeypatch.setenv(IGNORE_LIMITS_ENV, "1")
    out = CliRunner().invoke(model_group, ["check", str(model), "--max-tokens", "12"])
    assert out.exit_code == 1, out.output
    assert "batched parity:  FAIL" in out.output
    assert "differs from sequential generate at token" in out.output
    assert "vision cache:    no (mlx-vlm's qwen3_vl" in out.output
