/*
 * skload: a load generator for the skippyd protocol, the counterpart of redis-benchmark.
 *
 * One thread drives N connections with epoll, each with one request outstanding (as redis-benchmark
 * does without pipelining), so the figure measures the daemon and not a Python client.
 *
 *   cc -O2 -o skload bench/skload.c
 *   skload SOCKET CONNECTIONS SECONDS [ping|lookup]
 *
 * Prints "<requests per second> <errors>".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define HEADER 24
#define MAXCONN 1024

typedef struct {
    int fd;
    uint8_t buf[65536];
    size_t have;
    uint64_t id;
} conn_t;

static size_t put_str(uint8_t *p, const char *s) {
    size_t n = strlen(s);
    p[0] = 0xa0 | (uint8_t)n; /* fixstr, n < 32 */
    memcpy(p + 1, s, n);
    return n + 1;
}

static size_t frame(uint8_t *out, uint64_t id, const uint8_t *body, uint32_t len) {
    memcpy(out, "SKPD", 4);
    out[4] = 1; out[5] = 1; out[6] = 0; out[7] = 0;
    memcpy(out + 8, &len, 4);
    memset(out + 12, 0, 4);
    memcpy(out + 16, &id, 8);
    memcpy(out + HEADER, body, len);
    return HEADER + len;
}

static size_t body_hello(uint8_t *b) {
    size_t n = 0;
    b[n++] = 0x82;
    n += put_str(b + n, "op");
    n += put_str(b + n, "hello");
    n += put_str(b + n, "versions");
    b[n++] = 0x91; b[n++] = 0x01;
    return n;
}

static size_t body_op(uint8_t *b, const char *op) {
    size_t n = 0;
    if (strcmp(op, "ping") == 0) {
        b[n++] = 0x81;
        n += put_str(b + n, "op");
        n += put_str(b + n, "ping");
        return n;
    }
    b[n++] = 0x85;
    n += put_str(b + n, "op");
    n += put_str(b + n, "lookup");
    n += put_str(b + n, "model");
    n += put_str(b + n, "nobody");
    n += put_str(b + n, "state");
    n += put_str(b + n, "bench-state");
    n += put_str(b + n, "namespace");
    n += put_str(b + n, "");
    n += put_str(b + n, "tokens");
    b[n++] = 0xc4; b[n++] = 64; /* bin8: 16 tokens */
    for (int i = 0; i < 16; i++) { uint32_t t = (uint32_t)i; memcpy(b + n, &t, 4); n += 4; }
    return n;
}

static int send_all(int fd, const uint8_t *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0) { if (errno == EINTR || errno == EAGAIN) continue; return -1; }
        p += w; n -= (size_t)w;
    }
    return 0;
}

/* returns 1 when a whole frame is buffered (and consumes it), 0 when more bytes are needed */
static int take_frame(conn_t *c, int *is_error) {
    if (c->have < HEADER) return 0;
    uint32_t len;
    memcpy(&len, c->buf + 8, 4);
    if (c->have < HEADER + len) return 0;
    *is_error = c->buf[5] == 3;
    memmove(c->buf, c->buf + HEADER + len, c->have - HEADER - len);
    c->have -= HEADER + len;
    return 1;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s SOCKET CONNECTIONS SECONDS [ping|lookup]\n", argv[0]); return 2; }
    const char *path = argv[1];
    int n = atoi(argv[2]);
    double seconds = atof(argv[3]);
    const char *op = argc > 4 ? argv[4] : "lookup";
    if (n < 1 || n > MAXCONN) return 2;
    static conn_t conns[MAXCONN];
    uint8_t body[256], req[512], hello[256];
    size_t hello_len = frame(hello, 1, body, (uint32_t)body_hello(body));
    size_t body_len = body_op(body, op);
    int ep = epoll_create1(0);
    for (int i = 0; i < n; i++) {
        conn_t *c = &conns[i];
        c->fd = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        strncpy(a.sun_path, path, sizeof a.sun_path - 1);
        if (connect(c->fd, (struct sockaddr *)&a, sizeof a) < 0) { perror("connect"); return 1; }
        if (send_all(c->fd, hello, hello_len) < 0) return 1;
        int err = 0;
        while (!take_frame(c, &err)) {
            ssize_t r = recv(c->fd, c->buf + c->have, sizeof c->buf - c->have, 0);
            if (r <= 0) { fprintf(stderr, "handshake failed\n"); return 1; }
            c->have += (size_t)r;
        }
        if (err) { fprintf(stderr, "handshake refused\n"); return 1; }
        c->id = 2;
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev);
    }
    long done = 0, errors = 0;
    double start = now(), deadline = start + seconds;
    for (int i = 0; i < n; i++) {
        size_t len = frame(req, conns[i].id++, body, (uint32_t)body_len);
        send_all(conns[i].fd, req, len);
    }
    struct epoll_event events[MAXCONN];
    while (now() < deadline) {
        int k = epoll_wait(ep, events, MAXCONN, 100);
        for (int e = 0; e < k; e++) {
            conn_t *c = &conns[events[e].data.u32];
            ssize_t r = recv(c->fd, c->buf + c->have, sizeof c->buf - c->have, 0);
            if (r <= 0) { fprintf(stderr, "connection lost\n"); return 1; }
            c->have += (size_t)r;
            int err = 0;
            while (take_frame(c, &err)) {
                done++;
                errors += err;
                size_t len = frame(req, c->id++, body, (uint32_t)body_len);
                send_all(c->fd, req, len);
            }
        }
    }
    double elapsed = now() - start;
    printf("%.0f %ld\n", done / elapsed, errors);
    return 0;
}
