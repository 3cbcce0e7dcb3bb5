"""`nextstate`: the command line. Each subcommand's --help is its manual.

The top of the house: the commands import the gateway, the scoring workers, the trainer and the
pool; nothing imports them. Shared option groups live in :mod:`nextstate.cli.options`.
"""

from __future__ import annotations

import click

from nextstate.cli import options
from nextstate.cli.policy import policy_cli
from nextstate.cli.privacy import audit_cmd, forget
from nextstate.cli.rollout import rollout
from nextstate.cli.serve import config_group, db, gateway, up, worker
from nextstate.cli.train import train
from nextstate.cli.vllm import vllm_cli


@click.group(context_settings=options.CONTEXT)
@click.version_option(package_name="nextstate")
def main() -> None:
    """nextstate: an OpenAI-compatible proxy that turns every agent call into training signal.

    Point an agent's base_url at the gateway; every call is served by the upstream model
    server (vLLM, or any LiteLLM provider) and captured, with its next state, into the
    datapool.

    Every option can also be set in the environment as NEXTSTATE_<OPTION> (e.g.
    NEXTSTATE_DATABASE_URL) or in a YAML/TOML file named by NEXTSTATE_CONFIG.
    """


for command in (gateway, worker, train, db, up, config_group, rollout, vllm_cli, policy_cli, forget, audit_cmd):
    main.add_command(command)
