"""What each process runs in the divided-input tests (JAX processes,
TensorFlow workers).

`python divided_input_script.py OUT CASES` runs every case of
`divided_input_workers` (CASES: a JSON list of its keyword arguments), each
process with its own torch seed (a loader's shuffle must still be process
0's), and pickles the results to `OUT/results<process>.pkl`;
`... OUT fail` runs the pipeline that raises on process 1; `... OUT crafted`
the generator whose first batch for process 1 an intruder wrote first,
leaving `OUT/ran` if the payload was unpickled.
"""

import json
import os
import pickle
import sys

import divided_input_workers as workers


def main(out, cases):
    process = workers.process_index()
    if cases == "fail":
        workers.pipeline_fails_on_rank_1()
        return
    if cases == "crafted":
        workers.crafted_batch_reaches_process_1(os.path.join(out, "ran"))
        return
    results = [
        workers.run(**dict(case, torch_seed=process)) for case in json.loads(cases)
    ]
    with open(os.path.join(out, f"results{process}.pkl"), "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
