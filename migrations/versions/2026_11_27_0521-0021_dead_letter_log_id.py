"""dead_letter_log_id: dead letters keyed by the log's identity, as the offsets are

After a broker log reset (a topic re-created, a cluster restored) the same (partition, offset)
holds another record; unique on (topic, partition, offset) alone, a malformed record of the new
log at a position an old one held was silently dropped. Rows stored before know no log (NULL);
NULLS NOT DISTINCT keeps a redelivery of such a record one row.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-27 05:21:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = '0021'
down_revision: Union[str, None] = '0020'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column('dead_letter', sa.Column(
        'log_id', sa.String(length=128), nullable=True,
        comment="identity of the log the offset counts in (the broker's topic id, as consumer_offset.log_id); "
        "NULL: not known"))
    op.drop_constraint('uq_dead_letter_topic_partition_offset', 'dead_letter', type_='unique')
    op.create_unique_constraint('uq_dead_letter_topic_partition_offset_log_id', 'dead_letter',
                                ['topic', 'partition', 'offset', 'log_id'], postgresql_nulls_not_distinct=True)


def downgrade() -> None:
    # Rows of a newer log at a position an older one holds cannot stay under the narrower key.
    op.execute('DELETE FROM dead_letter d USING dead_letter o WHERE d.topic = o.topic AND d.partition = o.partition '
               'AND d."offset" = o."offset" AND d.id > o.id')
    op.drop_constraint('uq_dead_letter_topic_partition_offset_log_id', 'dead_letter', type_='unique')
    op.create_unique_constraint('uq_dead_letter_topic_partition_offset', 'dead_letter', ['topic', 'partition', 'offset'])
    op.drop_column('dead_letter', 'log_id')
