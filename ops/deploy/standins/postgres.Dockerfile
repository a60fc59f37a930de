# A stand-in for postgres:16 on hosts that cannot pull it: Debian bookworm's PostgreSQL 15, started as
# the official image starts (POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB; data in
# /var/lib/postgresql/data; extra arguments go to postgres). For test hosts only.
ARG DEBIAN_IMAGE=flywheel-standin/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
USER postgres
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]
