# The example Spark job of docker-compose.yml: Java 17 (Spark 4 needs it) and Python 3.11 with metaq and
# pyspark, running docker/pipeline.py in local mode. Build from the repository root:
#   docker build -f docker/spark-job.Dockerfile -t metaq-spark-job .
# Java comes from the Eclipse Temurin image rather than apt: a JRE copied between glibc images is the
# pattern Temurin documents, and it keeps Python the same 3.11 as the broker image.
FROM eclipse-temurin:17-jre-jammy AS java

FROM python:3.11-slim-bookworm
ENV JAVA_HOME=/opt/java/openjdk \
    PATH=/opt/java/openjdk/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
COPY --from=java /opt/java/openjdk /opt/java/openjdk

RUN groupadd --system --gid 10001 metaq \
    && useradd --system --uid 10001 --gid metaq --home-dir /home/metaq --create-home \
       --shell /usr/sbin/nologin metaq \
    && mkdir -p /var/lib/metaq-job \
    && chown metaq:metaq /var/lib/metaq-job

WORKDIR /opt/metaq/src
COPY setup.py README.md ./
COPY metaq_broker/ metaq_broker/
COPY metaq_spark/ metaq_spark/
RUN pip install --no-cache-dir . \
    && java -version \
    && python -c "import pyspark, metaq_spark"
COPY docker/pipeline.py /opt/metaq/pipeline.py

# Spark's checkpoint: a rerun of the job resumes where the last one stopped.
VOLUME ["/var/lib/metaq-job"]
WORKDIR /home/metaq
USER 10001:10001
ENTRYPOINT ["python", "/opt/metaq/pipeline.py"]
