/*
 * test_err.c - err_name() is stable and total; log lines honour the threshold.
 */
#include "engine/shared/err.h"

#include <string.h>

#include "tests/check.h"

int main(void)
{
    CHECK(strcmp(err_name(ERR_OK), "ERR_OK") == 0);
    CHECK(strcmp(err_name(ERR_FORMAT), "ERR_FORMAT") == 0);
    CHECK(strcmp(err_name(ERR_DB), "ERR_DB") == 0);
    CHECK(strcmp(err_name((Err) 999), "ERR_UNKNOWN") == 0);
    log_set_level(LOG_LEVEL_WARN);
    CHECK(!log_enabled(LOG_LEVEL_INFO));
    CHECK(log_enabled(LOG_LEVEL_ERROR));
    return check_exit();
}
