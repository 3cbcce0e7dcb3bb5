"""turns.effective_reward: the reward a turn shows, stored on the turn and kept by triggers

The admin UI filters and sorts turns and sessions by the reward a turn shows: a person's
override in force (the newest ``override`` label of the turn, else of its session; a null value
withdraws it), else its judgement's reward. Computed per row at read time that took 0.4-0.8 s
at 50,000 turns; stored here it is a column with an index. Database triggers keep it current
on every write, whoever makes it (the scorer, a label, a retry, a test's direct insert):

* ``judgements`` insert (with a reward), update of ``reward``, delete: the turn;
* ``labels`` insert, update, delete of an ``override``: its turn, or every turn of its session;
* ``turns`` insert (or a change of ``session_id``): the session's override, if there is one.

Existing rows are backfilled with the same expression. Indexes serve the turns view's sorts
(reward, latency, completion tokens) and the reward filters.

SQLite: a batch migration that recreates ``turns``, ``judgements`` or ``labels`` drops their
triggers; such a migration must create them again (see ``_sqlite_triggers``).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def expr(turn_id: str, session_id: str) -> str:
    """SQL (PostgreSQL and SQLite alike): the effective reward of the turn with these ids."""
    latest = ("(SELECT CAST(l.value AS TEXT) FROM labels l WHERE l.kind = 'override' AND l.{col} = {key} "
              "ORDER BY l.id DESC LIMIT 1)")
    return (f"COALESCE(CAST(COALESCE({latest.format(col='turn_id', key=turn_id)}, "
            f"{latest.format(col='session_id', key=session_id)}) AS FLOAT), "
            f"(SELECT j.reward FROM judgements j WHERE j.turn_id = {turn_id}))")


ROW = expr("turns.id", "turns.session_id")

PG_FUNCTIONS = {
    "nextstate_reward_from_judgement": f"""
        BEGIN
            IF TG_OP IN ('UPDATE', 'DELETE') THEN
                UPDATE turns SET effective_reward = {ROW} WHERE id = OLD.turn_id;
            END IF;
            IF TG_OP = 'INSERT' OR (TG_OP = 'UPDATE' AND NEW.turn_id IS DISTINCT FROM OLD.turn_id) THEN
                UPDATE turns SET effective_reward = {ROW} WHERE id = NEW.turn_id;
            END IF;
            RETURN NULL;
        END""",
    "nextstate_reward_from_label": f"""
        BEGIN
            IF TG_OP IN ('UPDATE', 'DELETE') THEN
                UPDATE turns SET effective_reward = {ROW} WHERE id = OLD.turn_id OR session_id = OLD.session_id;
            END IF;
            IF TG_OP IN ('INSERT', 'UPDATE') THEN
                UPDATE turns SET effective_reward = {ROW} WHERE id = NEW.turn_id OR session_id = NEW.session_id;
            END IF;
            RETURN NULL;
        END""",
    "nextstate_reward_of_new_turn": f"""
        BEGIN
            NEW.effective_reward := {expr('NEW.id', 'NEW.session_id')};
            RETURN NEW;
        END""",
}
PG_TRIGGERS = [
    ("turns_reward_judgement_ins", "AFTER INSERT ON judgements FOR EACH ROW WHEN (NEW.reward IS NOT NULL)",
     "nextstate_reward_from_judgement"),
    ("turns_reward_judgement_upd",
     ("AFTER UPDATE OF reward, turn_id ON judgements FOR EACH ROW "
      "WHEN (OLD.reward IS DISTINCT FROM NEW.reward OR OLD.turn_id IS DISTINCT FROM NEW.turn_id)"),
     "nextstate_reward_from_judgement"),
    ("turns_reward_judgement_del", "AFTER DELETE ON judgements FOR EACH ROW WHEN (OLD.reward IS NOT NULL)",
     "nextstate_reward_from_judgement"),
    ("turns_reward_label_ins", "AFTER INSERT ON labels FOR EACH ROW WHEN (NEW.kind = 'override')",
     "nextstate_reward_from_label"),
    ("turns_reward_label_upd", ("AFTER UPDATE ON labels FOR EACH ROW "
                                "WHEN (OLD.kind = 'override' OR NEW.kind = 'override')"), "nextstate_reward_from_label"),
    ("turns_reward_label_del", "AFTER DELETE ON labels FOR EACH ROW WHEN (OLD.kind = 'override')",
     "nextstate_reward_from_label"),
    ("turns_reward_new_turn", "BEFORE INSERT OR UPDATE OF session_id ON turns FOR EACH ROW",
     "nextstate_reward_of_new_turn"),
]


def _sqlite_triggers() -> dict[str, str]:
    def refresh(where: str) -> str:
        return f"UPDATE turns SET effective_reward = {ROW} WHERE {where};"

    label_old = refresh("id = OLD.turn_id OR session_id = OLD.session_id")
    label_new = refresh("id = NEW.turn_id OR session_id = NEW.session_id")
    return {
        "turns_reward_judgement_ins": f"AFTER INSERT ON judgements WHEN NEW.reward IS NOT NULL "
                                      f"BEGIN {refresh('id = NEW.turn_id')} END",
        "turns_reward_judgement_upd": f"AFTER UPDATE OF reward, turn_id ON judgements "
                                      f"WHEN OLD.reward IS NOT NEW.reward OR OLD.turn_id IS NOT NEW.turn_id "
                                      f"BEGIN {refresh('id = OLD.turn_id')} {refresh('id = NEW.turn_id')} END",
        "turns_reward_judgement_del": f"AFTER DELETE ON judgements WHEN OLD.reward IS NOT NULL "
                                      f"BEGIN {refresh('id = OLD.turn_id')} END",
        "turns_reward_label_ins": f"AFTER INSERT ON labels WHEN NEW.kind = 'override' BEGIN {label_new} END",
        "turns_reward_label_upd": f"AFTER UPDATE ON labels WHEN OLD.kind = 'override' OR NEW.kind = 'override' "
                                  f"BEGIN {label_old} {label_new} END",
        "turns_reward_label_del": f"AFTER DELETE ON labels WHEN OLD.kind = 'override' BEGIN {label_old} END",
        # SQLite cannot assign NEW in a BEFORE trigger: set it after, only where an override applies
        "turns_reward_new_turn": "AFTER INSERT ON turns WHEN EXISTS (SELECT 1 FROM labels WHERE "
                                 f"labels.session_id = NEW.session_id AND labels.kind = 'override') "
                                 f"BEGIN {refresh('id = NEW.id')} END",
        "turns_reward_turn_moved": f"AFTER UPDATE OF session_id ON turns BEGIN {refresh('id = NEW.id')} END",
    }


def upgrade() -> None:
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.add_column(sa.Column('effective_reward', sa.Float(), nullable=True))
    op.execute(f"UPDATE turns SET effective_reward = {ROW} WHERE EXISTS (SELECT 1 FROM judgements j "
               "WHERE j.turn_id = turns.id AND j.reward IS NOT NULL) OR EXISTS (SELECT 1 FROM labels l "
               "WHERE l.kind = 'override' AND (l.turn_id = turns.id OR l.session_id = turns.session_id))")
    if op.get_bind().dialect.name == "postgresql":
        for name, body in PG_FUNCTIONS.items():
            op.execute(f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $${body}\n$$")
        for name, when, fn in PG_TRIGGERS:
            op.execute(f"CREATE TRIGGER {name} {when} EXECUTE FUNCTION {fn}()")
    else:
        for name, body in _sqlite_triggers().items():
            op.execute(f"CREATE TRIGGER {name} {body}")
    _indexes(create=True)


SORTED = ("effective_reward", "latency_ms")
# every string of the request, reply and next state as words: the full-text filter's document
SEARCH = ("""(((jsonb_to_tsvector('english'::regconfig, request, '["string"]'::jsonb) || """
          """jsonb_to_tsvector('english'::regconfig, COALESCE(response, 'null'::jsonb), '["string"]'::jsonb)) || """
          """jsonb_to_tsvector('english'::regconfig, COALESCE(next_state, 'null'::jsonb), '["string"]'::jsonb)))""")
TOKENS = "(((usage ->> 'completion_tokens'::text))::double precision)"


def _indexes(create: bool) -> None:
    """Per column: (col, id) ascending; on PostgreSQL also (col DESC NULLS LAST, id DESC), the
    order the descending sort asks for (SQLite's plain index serves both)."""
    pg = op.get_bind().dialect.name == "postgresql"
    for c in SORTED:
        if create:
            op.create_index(f"ix_turns_{c}_asc", 'turns', [c, 'id'])
            if pg:
                op.create_index(f"ix_turns_{c}_desc", 'turns', [sa.text(f"{c} DESC NULLS LAST"), sa.text("id DESC")])
        else:
            op.drop_index(f"ix_turns_{c}_asc", table_name='turns')
            if pg:
                op.drop_index(f"ix_turns_{c}_desc", table_name='turns')
    if pg:  # the completion-tokens sort reads the usage JSON
        if create:
            op.create_index("ix_turns_completion_tokens_asc", 'turns', [sa.text(TOKENS), sa.text("id")])
            op.create_index("ix_turns_completion_tokens_desc", 'turns',
                            [sa.text(f"{TOKENS} DESC NULLS LAST"), sa.text("id DESC")])
            op.create_index("ix_turns_search", 'turns', [sa.text(SEARCH)], postgresql_using="gin")
            op.execute("ANALYZE turns")
        else:
            op.drop_index("ix_turns_completion_tokens_asc", table_name='turns')
            op.drop_index("ix_turns_completion_tokens_desc", table_name='turns')
            op.drop_index("ix_turns_search", table_name='turns')


def downgrade() -> None:
    _indexes(create=False)
    if op.get_bind().dialect.name == "postgresql":
        for name, when, _ in PG_TRIGGERS:
            table = when.split(" ON ")[1].split()[0]
            op.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
        for name in PG_FUNCTIONS:
            op.execute(f"DROP FUNCTION IF EXISTS {name}()")
    else:
        for name in _sqlite_triggers():
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.drop_column('effective_reward')
