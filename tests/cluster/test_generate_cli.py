"""`fleetserve generate`: the offline one-shot command."""

import pytest

from fleetserve.cluster.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from fleetserve.replica.testing import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("gen-model")))


def test_generate_prints_the_engine_output(tiny_dir, capsys):
    from fleetserve.replica.llm import LLM
    from fleetserve.scheduler import SamplingParams

    rc = main(
        [
            "generate",
            "The quick brown fox",
            "--model",
            tiny_dir,
            "--dtype",
            "float32",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--quiet",
            "--num-threads",
            "1",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    llm = LLM(tiny_dir, dtype="float32", num_threads=1)
    (ref,) = llm.generate(
        "The quick brown fox", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert printed == ref.outputs[0].text + "\n"


def test_generate_with_speculative_config_prints_the_same(tiny_dir, capsys):
    argv = [
        "generate",
        "def add(a, b):",
        "--model",
        tiny_dir,
        "--dtype",
        "float32",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--quiet",
        "--num-threads",
        "1",
    ]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    assert main(argv + ["--speculative-config", spec]) == 0
    assert capsys.readouterr().out == plain


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "no-such-model"], "unknown model"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--temperature", "inf"], "temperature must be a finite number"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens"),
    ],
)
def test_generate_bad_input_is_a_clear_message(tiny_dir, capsys, argv, message):
    argv = ["generate", "hi", "--quiet"] + (argv if argv[0] == "--model" else ["--model", tiny_dir] + argv)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_bad_speculative_json_is_a_usage_error(tiny_dir, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse rejects it, as any malformed flag
        main(["generate", "hi", "--quiet", "--model", tiny_dir, "--speculative-config", "{bad"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-config: not valid JSON" in err and "Traceback" not in err


BROKEN_FOLDERS = [
    ({"model_type": "llama", "hidden_size": "x"}, "whole", "config hidden_size must be a positive integer"),
    ({"model_type": "gpt2"}, "whole", "unsupported model architecture 'gpt2'"),
    (None, "none", "no *.safetensors files"),
    (None, "truncated", "corrupt or truncated weight file"),
    (None, "bad header", "corrupt or unreadable weight file"),
    ("{not json", "whole", "cannot read the model config"),
]


@pytest.mark.parametrize("config, weights, message", BROKEN_FOLDERS)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_broken_model_folder_is_refused_before_loading(
    tmp_path, tiny_dir, capsys, monkeypatch, command, config, weights, message
):
    """A folder whose config.json our model cannot read, without weights or with a truncated
    weight file: exit 2 with one line naming the file. It used to be a traceback from
    transformers' tokenizer (generate), or a start of Ray and Serve whose replicas each failed
    to load it and Serve gave up ~40 s later with its own traceback (serve)."""
    import json
    import shutil
    from pathlib import Path

    from fleetserve.cluster import lifecycle

    monkeypatch.setattr(lifecycle, "run_server", lambda config: pytest.fail("serve went on to start Ray"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    for f in folder.glob("*.safetensors"):
        data = f.read_bytes()
        if weights == "none":
            f.unlink()
        elif weights == "truncated":  # a download or copy cut short
            f.write_bytes(data[:-100])
        elif weights == "bad header":
            f.write_bytes(data[:8] + b"#" + data[9:])  # not JSON
    if config is not None:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    argv = (
        ["generate", "hi", "--quiet"] if command == "generate" else ["serve", "--port", "0", "--grpc-port", "0"]
    )  # (port 0: no port probe)
    assert main(argv + ["--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(Path(folder)) in err and "Traceback" not in err, err
