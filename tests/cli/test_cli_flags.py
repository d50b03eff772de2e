"""The command line's flags as llama-cli users type them: every llama-cli flag is either accepted with its
meaning or refused by name (never misparsed as a cluster of short flags); --help shows every default;
--version. Parsing only: nothing here loads a model."""

from __future__ import annotations

import re

import pytest

from poot_core.cli.main import build_parser, main

# Every flag of llama-cli and llama-completion (llama.cpp's interactive tools), from common/arg.cpp of the
# llama.cpp that llama-cpp-python 0.3.36 vendors (the source package scripts/fetch_test_data.py downloads):
# the options whose examples include LLAMA_EXAMPLE_CLI, LLAMA_EXAMPLE_COMPLETION or LLAMA_EXAMPLE_COMMON,
# with their negative forms. VALUE flags take one value, SWITCH flags none.
VALUE = """
--adaptive-decay --adaptive-target --audio --batch-size --binary-file --cache-ram --cache-type-k
--cache-type-k-draft --cache-type-v --cache-type-v-draft --chat-template --chat-template-file
--chat-template-kwargs --color --control-vector --control-vector-scaled --cpu-mask --cpu-mask-batch
--cpu-mask-batch-draft --cpu-mask-draft --cpu-range --cpu-range-batch --cpu-range-draft --cpu-strict
--cpu-strict-batch --cpu-strict-batch-draft --cpu-strict-draft --ctx-checkpoints --ctx-size --defrag-thold
--device --device-draft --docker-repo --draft --draft-max --draft-min --draft-n --draft-n-min --draft-p-min
--draft-p-split --dry-allowed-length --dry-base --dry-multiplier --dry-penalty-last-n --dry-sequence-breaker
--dynatemp-exp --dynatemp-range --file --fit --fit-ctx --fit-target --flash-attn --frequency-penalty
--gpu-layers --gpu-layers-draft --grammar --grammar-file --grp-attn-n --grp-attn-w --hf-file --hf-repo
--hf-repo-draft --hf-token --image --image-max-tokens --image-min-tokens --in-prefix --in-suffix
--json-schema --json-schema-file --keep --lazy-mode --load-mode --log-colors --log-file --log-prompts-dir
--log-verbosity --logit-bias --lora --lora-scaled --main-gpu --min-p --mirostat --mirostat-ent --mirostat-lr
--mmproj --mmproj-device --mmproj-url --model --model-draft --model-url --n-cpu-ffn --n-cpu-moe
--n-cpu-moe-draft --n-gpu-layers --n-gpu-layers-draft --n-predict --numa --output --output-file
--override-kv --override-tensor --override-tensor-draft --parallel --poll --poll-batch --poll-batch-draft
--poll-draft --predict --presence-penalty --print-token-count --prio --prio-batch --prio-batch-draft
--prio-draft --prompt --prompt-cache --reasoning --reasoning-budget --reasoning-budget-message
--reasoning-effort --reasoning-format --repeat-last-n --repeat-penalty --reverse-prompt --rope-freq-base
--rope-freq-scale --rope-scale --rope-scaling --rpc --sampler-seq --samplers --sampling-seq --seed
--server-base --spec-draft-cpu-mask --spec-draft-cpu-mask-batch --spec-draft-cpu-range
--spec-draft-cpu-strict --spec-draft-cpu-strict-batch --spec-draft-device --spec-draft-hf --spec-draft-model
--spec-draft-n-cpu-moe --spec-draft-n-max --spec-draft-n-min --spec-draft-ncmoe --spec-draft-ngl
--spec-draft-override-tensor --spec-draft-p-min --spec-draft-p-split --spec-draft-poll
--spec-draft-poll-batch --spec-draft-prio --spec-draft-prio-batch --spec-draft-threads
--spec-draft-threads-batch --spec-draft-type-k --spec-draft-type-v --spec-ngram-map-k-min-hits
--spec-ngram-map-k-size-m --spec-ngram-map-k-size-n --spec-ngram-map-k4v-min-hits
--spec-ngram-map-k4v-size-m --spec-ngram-map-k4v-size-n --spec-ngram-mod-n-match --spec-ngram-mod-n-max
--spec-ngram-mod-n-min --spec-ngram-simple-min-hits --spec-ngram-simple-size-m --spec-ngram-simple-size-n
--spec-synth-len --spec-synth-rates --spec-type --split-mode --swa-checkpoints --system-prompt
--system-prompt-file --temp --temperature --tensor-split --threads --threads-batch --threads-batch-draft
--threads-draft --top-k --top-n-sigma --top-nsigma --top-p --typical --typical-p --ubatch-size --verbosity
--video --video-ffmpeg-dir --video-fps --video-timestamp-interval --xtc-probability --xtc-threshold
--yarn-attn-factor --yarn-beta-fast --yarn-beta-slow --yarn-ext-factor --yarn-orig-ctx -C -Cb -Cbd -Cd -Cr
-Crb -Crd -b -bf -c -co -cram -ctk -ctkd -ctv -ctvd -ctxcp -dev -devd -dr -dt -f -fa -fit -fitc -fitt -gan
-gaw -hf -hfd -hff -hfr -hfrd -hft -j -jf -l -lm -lv -lzm -m -md -mg -mm -mmdev -mmu -mu -n -ncffn -ncmoe
-ncmoed -ngl -ngld -np -o -ot -otd -p -ptc -r -rea -s -sm -sys -sysf -t -tb -tbd -td -ts -ub
--control-vector-layer-range
""".split()
SWITCH = """
--backend-sampling --cache-list --check-tensors --completion-bash --context-shift --conversation --cpu-moe
--cpu-moe-draft --display-prompt --escape --gpt-oss-120b-default --gpt-oss-20b-default --help --ignore-eos
--in-prefix-bos --interactive --interactive-first --jinja --kv-offload --list-devices --log-disable
--log-jsonl --log-prefix --log-timestamps --log-verbose --mmproj-auto --mmproj-offload --multiline-input
--no-context-shift --no-conversation --no-display-prompt --no-escape --no-host --no-jinja --no-kv-offload
--no-log-jsonl --no-log-prefix --no-log-timestamps --no-mmproj --no-mmproj-auto --no-mmproj-offload
--no-op-offload --no-perf --no-reasoning-preserve --no-repack --no-show-timings --no-skip-chat-parsing
--no-spec-draft-backend-sampling --no-warmup --offline --op-offload --perf --prompt-cache-all
--prompt-cache-ro --reasoning-preserve --repack --show-timings --simple-io --single-turn --skip-chat-parsing
--spec-default --spec-draft-backend-sampling --spec-draft-cpu-moe --special --swa-full --usage --verbose
--verbose-prompt --version --vision-gemma-12b-default --vision-gemma-4b-default --warmup -bs -cl -cmoe
-cmoed -cnv -e -h -i -if -kvo -mli -nkvo -no-cnv -nr -sp -st -v
""".split()

# The llama-cli flags `poot generate` accepts, with the value given and what it must parse to: llama-cli's
# meaning of each (the attribute poot keeps it in).
ACCEPTED: dict[str, tuple[list[str], str, object]] = {
    "-m": (["x.gguf"], "model", "x.gguf"), "--model": (["x.gguf"], "model", "x.gguf"),
    "-p": (["hi"], "prompt", "hi"), "--prompt": (["hi"], "prompt", "hi"),
    "-f": (["p.txt"], "file", "p.txt"), "--file": (["p.txt"], "file", "p.txt"),
    "--system-prompt": (["be brief"], "system_prompt", "be brief"),
    "-n": (["12"], "n_predict", 12), "--n-predict": (["12"], "n_predict", 12), "--predict": (["12"], "n_predict", 12),
    "-c": (["2048"], "ctx_size", 2048), "--ctx-size": (["2048"], "ctx_size", 2048),
    "-b": (["64"], "batch_size", 64), "--batch-size": (["64"], "batch_size", 64),
    "-t": (["3"], "threads", 3), "--threads": (["3"], "threads", 3),
    "-tb": (["5"], "threads_batch", 5), "--threads-batch": (["5"], "threads_batch", 5),
    "--temp": (["0.7"], "temp", 0.7), "--temperature": (["0.7"], "temp", 0.7),
    "--top-k": (["7"], "top_k", 7), "--top-p": (["0.5"], "top_p", 0.5), "--min-p": (["0.1"], "min_p", 0.1),
    "--repeat-penalty": (["1.3"], "repeat_penalty", 1.3),
    "-s": (["42"], "seed", 42), "--seed": (["42"], "seed", 42),
    "-r": (["User:"], "reverse_prompt", ["User:"]), "--reverse-prompt": (["User:"], "reverse_prompt", ["User:"]),
    "--ignore-eos": ([], "ignore_eos", True),
    "--chat-template": (["{{ x }}"], "chat_template", "{{ x }}"),
    "--chat-template-file": (["t.jinja"], "chat_template_file", "t.jinja"),
    "--conversation": ([], "conversation", True), "--no-conversation": ([], "conversation", False),
    "--single-turn": ([], "single_turn", True),
    "--show-timings": ([], "show_timings", True), "--no-show-timings": ([], "show_timings", False),
    "--verbose-prompt": ([], "verbose_prompt", True),
    "-v": ([], "verbose", True), "--verbose": ([], "verbose", True), "--log-verbose": ([], "verbose", True),
    "-md": (["d.gguf"], "model_draft", "d.gguf"), "--model-draft": (["d.gguf"], "model_draft", "d.gguf"),
    "--draft-max": (["6"], "draft_max", 6), "--draft-min": (["2"], "draft_min", 2),
    "--grammar": (['root ::= "a"'], "grammar", 'root ::= "a"'),
    "--grammar-file": (["g.gbnf"], "grammar_file", "g.gbnf"),
    "-j": (["{}"], "json_schema", "{}"), "--json-schema": (["{}"], "json_schema", "{}"),
    "-jf": (["s.json"], "json_schema_file", "s.json"), "--json-schema-file": (["s.json"], "json_schema_file", "s.json"),
    "-ts": (["3,1"], "tensor_split", "3,1"), "--tensor-split": (["3,1"], "tensor_split", "3,1"),
}
SPECIAL = {"-h", "--help", "--version"}  # print and exit 0: checked below


def _generate(*argv: str):
    return build_parser().parse_args(["generate", *argv])


def test_reference_list_is_whole():
    assert len(set(VALUE) | set(SWITCH)) == 365 and not set(VALUE) & set(SWITCH)
    assert set(ACCEPTED) | SPECIAL <= set(VALUE) | set(SWITCH)


@pytest.mark.parametrize("flag", sorted(set(VALUE) | set(SWITCH)))
def test_every_llama_cli_flag_is_accepted_with_its_meaning_or_refused_by_name(flag, capsys):
    if flag in SPECIAL:
        return
    values = ["99"] if flag in VALUE else []
    if flag == "--control-vector-layer-range":
        values = ["1", "2"]
    base = [] if flag in ("-m", "--model") else ["-m", "x.gguf"]
    if flag in ACCEPTED:
        given, attr, expected = ACCEPTED[flag]
        args = _generate(*base, flag, *given)
        assert getattr(args, attr) == expected
        return
    with pytest.raises(SystemExit) as exc:
        _generate(*base, "-p", "hi", flag, *values)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f" {flag}" in err  # named as given
    assert "invalid" not in err and "expected one argument" not in err  # not read as another flag + value


@pytest.mark.parametrize("argv,words", [
    (["-ngl", "99"], "--backend"),
    (["--n-gpu-layers", "99"], "--backend"),
    (["-cnv"], "--conversation"),
    (["-st"], "--single-turn"),
    (["-sys", "be brief"], "--system-prompt"),
    (["-i"], "--conversation"),
    (["-fa", "on"], "attention"),
    (["-hf", "user/model"], "never downloads"),
    (["--mirostat", "2"], "--temp"),
])
def test_refusals_say_what_poot_offers_instead(argv, words, capsys):
    with pytest.raises(SystemExit):
        _generate("-m", "x.gguf", "-p", "hi", *argv)
    err = capsys.readouterr().err
    assert argv[0] in err and words in err


def test_no_abbreviations_or_attached_short_values(capsys):
    for argv in (["--ctx", "64"], ["--temper", "1"], ["-n16"], ["-c0"], ["--show"]):
        with pytest.raises(SystemExit):
            _generate("-m", "x.gguf", "-p", "hi", *argv)
        assert argv[0] in capsys.readouterr().err


def test_values_that_look_like_flags_stay_values():
    args = _generate("-m", "x.gguf", "-p", "-ngl is not a flag here", "-n", "-1", "-s", "-1", "-r", "-")
    assert args.prompt == "-ngl is not a flag here" and args.n_predict == -1 and args.seed == -1
    assert args.reverse_prompt == ["-"]


def _option_lines(help_text: str) -> list[tuple[str, str]]:
    """(flags, help) of every option in argparse's --help output."""
    body = help_text.split("options:", 1)[1]
    entries: list[tuple[str, str]] = []
    for line in body.splitlines():
        if re.match(r"^  -", line):
            flags, _, rest = line.strip().partition("  ")
            entries.append((flags, rest.strip()))
        elif entries and line.startswith(" " * 10):
            flags, rest = entries[-1]
            entries[-1] = (flags, f"{rest} {line.strip()}")
    return entries


@pytest.mark.parametrize("command", [["generate"], ["perplexity"], ["embed", "vectors"], ["embed", "similarity"],
                                     ["embed", "rerank"]])
def test_help_shows_every_default(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    entries = _option_lines(capsys.readouterr().out)
    assert len(entries) >= 3
    for flags, text in entries:
        if flags.startswith(("-h,", "--version")):
            continue
        assert "default" in text or "required" in text, flags


def test_generate_help_names_the_defaults_users_ask_about(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("(default: 4096, or the model's window if smaller)", "(default: -1)", "(default: auto)",
                  "(default: 0.0)", "(default: 40;"):
        assert words in text


def test_version(capsys):
    from importlib import metadata

    for argv in (["--version"], ["generate", "--version"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
        assert capsys.readouterr().out.strip() == f"poot {metadata.version('poot-core')}"
