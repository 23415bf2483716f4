# A local stand-in for prom/prometheus (no image registry reachable here): the host's Debian
# Prometheus binary (only glibc beside it) on the Debian stand-in base, laid out like the
# upstream image (entrypoint, /prometheus working directory, user nobody).
ARG BASE=zerotuner-standin-base:bookworm
FROM ${BASE}
COPY prometheus /bin/prometheus
RUN mkdir -p /prometheus /etc/prometheus && chown 65534:65534 /prometheus
USER 65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml"]
