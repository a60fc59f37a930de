# A stand-in for python:3.11-slim on hosts that cannot pull it: Debian bookworm's Python 3.11, with pip
# installing into the system as the official image's does. It trusts the certificate authorities the
# host added for its own package clients (certs/: what ops/deploy/standins.sh copies from
# /usr/local/share/ca-certificates, e.g. a TLS-inspecting egress proxy's). For test hosts only.
ARG DEBIAN_IMAGE=flywheel-standin/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python3-dev \
        ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED \
    && ln -s /usr/bin/python3 /usr/local/bin/python && ln -s /usr/bin/pip3 /usr/local/bin/pip
COPY certs/ /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
CMD ["python3"]
