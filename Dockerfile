# Ren-Queue's image: `renqueue up` (routers and workers), `renqueue router`,
# `renqueue worker`, ... against the NATS of docker-compose.yml or any other.
#
#   docker build -t renqueue .
#   docker run --network host -e RENQUEUE_NATS_URL=nats://127.0.0.1:4222 \
#     -v $PWD/renqueue.toml:/etc/renqueue/renqueue.toml:ro renqueue
#
# `pip install .[mock]`: the package and the mock LLM backend (`renqueue
# mock-backend`, which docker-compose.yml's stack runs). The wheel carries the
# stream definitions of streams/ (as renqueue/_streams), so the installed
# command finds them without this checkout. To run other definitions, mount a
# directory and point RENQUEUE_STREAMS_DIR at it.
FROM python:3.11-slim

COPY pyproject.toml README.md /src/
COPY renqueue /src/renqueue
COPY streams /src/streams
RUN pip install --no-cache-dir "/src[mock]" && rm -rf /src \
    && useradd --system --create-home --home-dir /var/lib/renqueue renqueue

USER renqueue
WORKDIR /var/lib/renqueue
# Without RENQUEUE_NATS_URL, `renqueue up` starts the embedded nats-server with
# its store here; mount a volume on /var/lib/renqueue to keep it.
ENV RENQUEUE_CONFIG=/etc/renqueue/renqueue.toml \
    RENQUEUE_DATA_DIR=/var/lib/renqueue/data
# The OpenAI-compatible gateway (`[gateway]`, docs/gateway.md), which
# `renqueue up` starts when it has API keys: set `host = "0.0.0.0"` there to
# reach it from outside the container (its default is loopback only).
EXPOSE 8080
ENTRYPOINT ["renqueue"]
CMD ["up"]
