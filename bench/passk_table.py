"""Measure per-task pass counts of the real SmolLM2-135M-Instruct on sixteen one-line function
requests, the table ``bench/gate_power.py`` simulates the gate from by default.

Each task is a chat request ("Write a Python function `add(a, b)` ... Reply with a python code
block"), sampled ``--samples`` times at ``--temperature`` (the serving temperature, 0.7) with
Hugging Face ``generate``; the first python code block of each reply runs with the task's asserts
in a subprocess (5 s limit). Writes ``{"tasks": {name: [n, c]}, ...}`` as JSON and prints one JSON
line with the totals. The same kind of tasks as the in-reach ``functions`` suite; once that suite
has stored eval results, ``bench/gate_power.py --from-db`` reads those instead.

Flags: ``--samples N`` (8), ``--temperature T`` (0.7), ``--max-new-tokens N`` (96), ``--threads N`` (1),
``--out JSON`` (default ``bench/data/smollm2_functions_pass.json``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.checkpoints.publish import converted_base_dir

TASKS: dict[str, tuple[str, str]] = {
    "add": ("add(a, b) that returns the sum of a and b", "assert add(2, 3) == 5\nassert add(-1, 1) == 0"),
    "is_even": ("is_even(n) that returns True if n is even", "assert is_even(4)\nassert not is_even(7)"),
    "square": ("square(x) that returns x squared", "assert square(3) == 9\nassert square(-4) == 16"),
    "maximum": (
        "maximum(xs) that returns the largest number in the list xs",
        "assert maximum([3, 9, 2]) == 9\nassert maximum([-5, -2]) == -2",
    ),
    "reverse_string": (
        "reverse_string(s) that returns the string s reversed",
        "assert reverse_string('abc') == 'cba'\nassert reverse_string('') == ''",
    ),
    "count_vowels": (
        "count_vowels(s) that returns the number of vowels (a, e, i, o, u) in s",
        "assert count_vowels('hello') == 2\nassert count_vowels('xyz') == 0",
    ),
    "factorial": ("factorial(n) that returns n factorial", "assert factorial(5) == 120\nassert factorial(0) == 1"),
    "fib": (
        "fib(n) that returns the n-th Fibonacci number with fib(0) = 0 and fib(1) = 1",
        "assert fib(10) == 55\nassert fib(1) == 1",
    ),
    "is_palindrome": (
        "is_palindrome(s) that returns True if the string s reads the same backwards",
        "assert is_palindrome('racecar')\nassert not is_palindrome('abc')",
    ),
    "sum_list": (
        "sum_list(xs) that returns the sum of the numbers in xs",
        "assert sum_list([1, 2, 3]) == 6\nassert sum_list([]) == 0",
    ),
    "celsius_to_fahrenheit": (
        "celsius_to_fahrenheit(c) that converts degrees Celsius to Fahrenheit",
        "assert celsius_to_fahrenheit(100) == 212\nassert celsius_to_fahrenheit(0) == 32",
    ),
    "count_words": (
        "count_words(s) that returns the number of words in the string s separated by spaces",
        "assert count_words('a b c') == 3\nassert count_words('hello') == 1",
    ),
    "is_prime": (
        "is_prime(n) that returns True if n is a prime number",
        "assert is_prime(7)\nassert not is_prime(9)\nassert not is_prime(1)",
    ),
    "gcd": (
        "gcd(a, b) that returns the greatest common divisor of a and b",
        "assert gcd(12, 18) == 6\nassert gcd(7, 5) == 1",
    ),
    "remove_duplicates": (
        "remove_duplicates(xs) that returns the list xs without duplicates, keeping first order",
        "assert remove_duplicates([1, 2, 1, 3, 2]) == [1, 2, 3]",
    ),
    "capitalize_words": (
        "capitalize_words(s) that capitalizes the first letter of every word in s",
        "assert capitalize_words('hello world') == 'Hello World'",
    ),
}

CODE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def passes(reply: str, tests: str) -> bool:
    """Whether the first code block of ``reply`` passes ``tests`` (a 5 s subprocess)."""
    m = CODE.search(reply)
    if m is None:
        return False
    try:
        proc = subprocess.run([sys.executable, "-c", m.group(1) + "\n" + tests], capture_output=True, timeout=5)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy shared CPU)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "smollm2_functions_pass.json")
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    path = converted_base_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    counts: dict[str, list[int]] = {}
    started = time.perf_counter()
    for name, (spec, tests) in TASKS.items():
        msgs = [{"role": "user", "content": f"Write a Python function {spec}. Reply with a python code block."}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(
                **ids,
                do_sample=True,
                temperature=args.temperature,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                num_return_sequences=args.samples,
                pad_token_id=tok.eos_token_id,
            )
        replies = tok.batch_decode(out[:, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        counts[name] = [len(replies), sum(passes(r, tests) for r in replies)]
        print(f"{name:<24} {counts[name][1]}/{counts[name][0]}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started
    n, c = sum(v[0] for v in counts.values()), sum(v[1] for v in counts.values())
    table = {
        "model": "SmolLM2-135M-Instruct (fp32, CPU)",
        "temperature": args.temperature,
        "top_p": 1.0,
        "max_new_tokens": args.max_new_tokens,
        "prompt": "chat: 'Write a Python function <spec>. Reply with a python code block.'",
        "generated_by": "bench/passk_table.py",
        "tasks": counts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(
        json.dumps(
            {
                "bench": "passk_table",
                "ours": round(c / n, 4) if n else None,
                "baseline": None,
                "unit": "pass@1 (sampled, plain chat prompt)",
                "ratio": None,
                "target": "a table row for every task",
                "pass": len(counts) == len(TASKS) and all(v[0] == args.samples for v in counts.values()),
                "passed": c,
                "samples": n,
                "tasks": len(counts),
                "seconds": round(elapsed, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
