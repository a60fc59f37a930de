# A stand-in for redis:7 on hosts that cannot pull it: Debian bookworm's Redis 7.0, run as the redis
# user in /data (the official image's layout). For test hosts only.
ARG DEBIAN_IMAGE=flywheel-standin/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
CMD ["redis-server"]
