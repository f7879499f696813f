"""Load a SkyPilot task YAML with SkyPilot's own loader and print, as JSON, what a launch of it would run.

    SKY_PYTHON tests/scripts/sky_task.py TASK.yaml [--env K=V ...] [--secret K=V ...]

Run by an interpreter that has skypilot (requirements-sky.txt; tests/repo/test_readme.py builds one), not by echo2's.
"""

import argparse
import json

import yaml

import sky

p = argparse.ArgumentParser()
p.add_argument("yaml")
p.add_argument("--env", action="append", default=[])
p.add_argument("--secret", action="append", default=[])
a = p.parse_args()
with open(a.yaml) as f:
    config = yaml.safe_load(f)
task = sky.Task.from_yaml_config(config, env_overrides=[tuple(kv.split("=", 1)) for kv in a.env],
                                 secrets_overrides=[tuple(kv.split("=", 1)) for kv in a.secret])
resources = [{"accelerators": r.accelerators, "use_spot": r.use_spot, "job_recovery": r.job_recovery,
              "ports": r.ports} for r in task.resources]
print(json.dumps({"name": task.name, "run": task.run, "setup": task.setup, "workdir": task.workdir,
                  "envs": task.envs, "secrets": sorted(task.secrets), "resources": resources}, default=str))
