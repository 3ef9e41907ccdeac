module shardserve/configs/jaeger

go 1.25

require github.com/jaegertracing/jaeger v1.76.0
