"""mkdocs hooks of the documentation site (``mkdocs.yml``: ``hooks:``).

- The configuration and command-line reference (``docs/reference/config.md``, ``cli.md``) is
  generated from the code before every build by ``dfl_agent.cli.gen_reference``; a config key
  or CLI option without a description stops the build.
- Pages written by other parts of the project (:data:`OPTIONAL`) are dropped from the
  navigation while they do not exist, so that the strict build does not fail on them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.dfl_agent")

#: pages the navigation lists that may not exist yet
OPTIONAL = {"install.md", "cli.md", "security.md", "operations.md", "data-and-models.md",
            "algorithms-on-devices.md", "scale.md"}


def _prune(nav: Any, docs: Path) -> Any:
    if isinstance(nav, list):
        out = [_prune(item, docs) for item in nav]
        return [item for item in out if item is not None]
    if isinstance(nav, dict):
        out = {k: _prune(v, docs) for k, v in nav.items()}
        return {k: v for k, v in out.items() if v is not None and v != []} or None
    if isinstance(nav, str) and nav in OPTIONAL and not (docs / nav).exists():
        log.info("nav: %s does not exist yet; left out", nav)
        return None
    return nav


def on_config(config: Any, **kwargs: Any) -> Any:
    """Generate the reference pages, then drop missing optional pages from the nav."""
    from dfl_agent.cli import gen_reference

    docs = Path(config["docs_dir"])
    for path in gen_reference.write(docs / "reference"):
        log.info("generated %s", path)
    config["nav"] = _prune(config["nav"], docs)
    return config
