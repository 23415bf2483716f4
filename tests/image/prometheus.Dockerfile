# A local stand-in for prom/prometheus (no image registry reachable here): the host's Debian
# Prometheus and promtool (only glibc beside them) on the Debian stand-in base, laid out like
# the upstream image (entrypoint, /prometheus working directory and data, user nobody).
# Debian's build keeps its data in /var/lib/prometheus/metrics2 by default, upstream's in
# data/ under the working directory: the link puts both on compose.yaml's prometheus volume.
ARG BASE=zerotuner-standin-base:bookworm
FROM ${BASE}
COPY prometheus promtool /bin/
RUN mkdir -p /prometheus /etc/prometheus /var/lib/prometheus \
    && ln -s /prometheus /var/lib/prometheus/metrics2 \
    && chown 65534:65534 /prometheus
USER 65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml"]
