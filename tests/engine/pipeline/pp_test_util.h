/*
 * pp_test_util.h - shared by the pipeline tests that run ranks as threads (test_sched.c,
 * test_mtp_pp.c, test_pp_data.c): a free TCP port on 127.0.0.1 for rank 0's master address.
 */
#ifndef TESTS_ENGINE_PP_TEST_UTIL_H
#define TESTS_ENGINE_PP_TEST_UTIL_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "engine/shared/err.h"

// A port that was free a moment ago (bound, read back and released); aborts when none is.
static inline int pp_test_free_port(void)
{
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    ASSERT(fd >= 0 && bind(fd, (struct sockaddr *) &sa, sizeof sa) == 0
           && getsockname(fd, (struct sockaddr *) &sa, &len) == 0);
    close(fd);
    return ntohs(sa.sin_port);
}

#endif  // TESTS_ENGINE_PP_TEST_UTIL_H
