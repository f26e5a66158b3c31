/*
 * source_file.h - open a file of the source tree from a test (tests only; header-only).
 *
 * ctest runs tests in the build directory and sets GLMSPARK_SOURCE_DIR to the source tree;
 * run by hand from the source tree, "." is the default.
 *
 * Ownership: the caller fcloses the FILE.
 * Threads:   any.
 * Errors:    NULL, after printing the path and the reason, when the file cannot be opened.
 */
#ifndef TESTS_ENGINE_SHARED_SOURCE_FILE_H
#define TESTS_ENGINE_SHARED_SOURCE_FILE_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Open rel (a path from the repository root, e.g. "tests/golden/chat/cases.jsonl").
static inline FILE *source_fopen(const char *rel)
{
    const char *src = getenv("GLMSPARK_SOURCE_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", src ? src : ".", rel);
    FILE *f = fopen(path, "rb");
    if (!f) fprintf(stderr, "  could not open %s: %s\n", path, strerror(errno));
    return f;
}

#endif  // TESTS_ENGINE_SHARED_SOURCE_FILE_H
