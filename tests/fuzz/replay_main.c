/*
 * replay_main.c - run a libFuzzer target over its corpus without libFuzzer.
 *
 * Builds without FUZZ=ON (gcc, no clang) link each fuzz_<parser>.c against this driver so
 * that ctest replays every saved input: a crash once found stays a regression test in
 * every build, sanitized or not. Arguments are files or directories of inputs.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "could not open \"%s\"\n", path);
        return 1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        return 1;
    }
    for (;;) {
        if (n == cap) {
            uint8_t *bigger = realloc(buf, cap * 2);
            if (!bigger) {
                free(buf);
                fclose(f);
                return 1;
            }
            buf = bigger;
            cap *= 2;
        }
        const size_t got = fread(buf + n, 1, cap - n, f);
        if (got == 0) break;
        n += got;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    int n_inputs = 0, n_errors = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "no corpus at \"%s\"\n", argv[i]);
            n_errors++;
            continue;
        }
        if (!S_ISDIR(st.st_mode)) {
            n_errors += replay_file(argv[i]);
            n_inputs++;
            continue;
        }
        DIR *dir = opendir(argv[i]);
        if (!dir) {
            n_errors++;
            continue;
        }
        struct dirent *e;
        while ((e = readdir(dir))) {
            if (e->d_name[0] == '.') continue;
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[i], e->d_name);
            n_errors += replay_file(path);
            n_inputs++;
        }
        closedir(dir);
    }
    printf("%d passed, %d failed\n", n_inputs - n_errors, n_errors);
    return n_errors || n_inputs == 0 ? 1 : 0;
}
