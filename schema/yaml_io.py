"""PyYAML's libyaml reader and writer where PyYAML has them, else its own (the same safe
constructor and representer, so the same values): a build and the configs in it parse several
times faster, and the checks parse and the tests rewrite whole builds hundreds of times."""

from __future__ import annotations

import yaml

YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
